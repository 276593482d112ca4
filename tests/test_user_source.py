"""The user's line of what no stack shows any more, found in the source of the user's own classes
(``lit_ddp.analysis.user_source``): the ``self.log`` of a key Lightning reduces after its hook, and the line that set
``trainer.should_stop``."""

import torch
from lightning.pytorch import Callback, LightningModule

from lit_ddp.analysis.user_source import Stopped, logged_at
from lit_ddp.callbacks import StepSync


class Logs(LightningModule):
    def on_train_epoch_end(self) -> None:
        value = torch.tensor(1.0)
        self.log("epoch_metric", value, sync_dist=True)
        self.log("other", value)

    def training_step(self, batch, batch_idx):
        self.log_dict(self.metrics(), sync_dist=True)  # keys made at run time: the hook's only call
        if batch_idx == 3:
            self.trainer.should_stop = batch_idx > 2


class Stops(Callback):
    def on_train_batch_end(self, trainer, *args) -> None:
        trainer.should_stop = False  # not a stop
        if trainer.should_stop == 1:  # a comparison, not a stop
            pass


def test_the_line_that_logged_a_key_is_the_hooks_line_that_quotes_it_or_its_only_log_call():
    assert logged_at((Logs,), "on_train_epoch_end", "epoch_metric") == (
        'test_user_source.py:15 on_train_epoch_end: self.log("epoch_metric", value, sync_dist=True)'
    )
    assert logged_at((Logs,), "training_step", "loss") == (
        "test_user_source.py:19 training_step: self.log_dict(self.metrics(), sync_dist=True)"
    )
    # Two calls and no quote: the hook and the key, no line guessed
    assert (
        logged_at((Logs,), "on_train_epoch_end", "made") == "on_train_epoch_end: self.log('made', ..., sync_dist=True)"
    )


def test_a_stop_names_the_one_line_of_the_users_classes_that_sets_should_stop():
    assert Stopped(4, (Logs, Stops, StepSync)).text() == (
        "stopped training at step 4 (trainer.should_stop set at test_user_source.py:21 training_step: "
        "self.trainer.should_stop = batch_idx > 2)"
    )  # StepSync's own (lit_ddp's) and the callback's False and == are not the user's stop
    assert Stopped(4, (Stops,)).text() == "stopped training at step 4"
    assert Stopped(4, (Logs, Logs)).text().endswith("= batch_idx > 2)")  # a class given twice is read once

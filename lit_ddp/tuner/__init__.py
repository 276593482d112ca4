"""The DDP tuner, in one room: measures DDP's knobs on the user's model in its own ranks and names the fastest
beyond the noise (docs/tuning.md).

    python -m lit_ddp.tune --devices 2 --out tuned.yaml       # cli.py
    trainer = Trainer(strategy=LitDDPStrategy(), devices=2, callbacks=[DDPTuner()])

``knobs`` (what a configuration is, DDP's bucket layout), ``search`` (what to try, what is kept), ``trial`` (what a
configuration measured, and the noise model's word on two), ``bench`` (a configuration timed in the ranks),
``callback`` (``DDPTuner``, the Trainer's glue), ``verdict`` (what it prints), ``cli`` (fit's command line with the
tuner in place of training, and the config it writes).
"""

from lit_ddp.tuner.callback import DDPTuner

__all__ = ["DDPTuner"]

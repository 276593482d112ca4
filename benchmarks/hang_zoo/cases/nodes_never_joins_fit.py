"""Under ``python -m lit_ddp.fit`` with Lightning's launcher across two nodes (``MASTER_ADDR``, ``NODE_RANK``,
``--trainer.num_nodes 2``), node 1 never starts: node 0 waits at the rendezvous (Lightning#10098, #19817: "stuck at
Initializing distributed"). Run on the namespace nodes of nodes/cluster.sh; the hang starts with the job."""

from benchmarks.hang_zoo.expect import Hang

EXPECT = Hang(rank=1, line=None, cause="never joined")
NODES = (0,)  # node 1 is never started
COMMAND = ["-m", "lit_ddp.fit", "--devices", "1", "--trainer.num_nodes", "2", "--trainer.accelerator", "cpu",
           "--model.dim", "16", "--trainer.max_steps", "10", "--trainer.strategy.timeout_s", "{timeout_s}"]  # fmt: skip

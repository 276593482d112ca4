"""Under ``python -m lit_ddp.fit`` with Lightning's launcher across two nodes (``MASTER_ADDR``, ``NODE_RANK``,
``--trainer.num_nodes 2``), node 0, the rendezvous store's host, never starts: node 1's rank dials an address where
nothing listens (pytorch#58431: the worker nodes stuck in ``init_process_group``, the master out of their reach).
Run on the namespace nodes of nodes/cluster.sh; the hang starts with the job."""

from benchmarks.hang_zoo.expect import Hang

EXPECT = Hang(rank=0, line=None, cause="never joined")
NODES = (1,)  # node 0, MASTER_ADDR's, is never started
COMMAND = ["-m", "lit_ddp.fit", "--devices", "1", "--trainer.num_nodes", "2", "--trainer.accelerator", "cpu",
           "--model.dim", "16", "--trainer.max_steps", "10", "--trainer.strategy.timeout_s", "{timeout_s}"]  # fmt: skip

"""Two nodes of one rank each, under Lightning's launcher (``MASTER_ADDR``, ``NODE_RANK``, ``num_nodes=2``); node 1
never starts: node 0 waits at the rendezvous (Lightning#5651, #13087: stuck at "initializing ddp: GLOBAL_RANK: 0,
MEMBER: 1/N"). Run on the namespace nodes of nodes/cluster.sh."""

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=1, line=None, cause="never joined")
NODES = (0,)  # node 1 is never started

if __name__ == "__main__":
    hang_starts()
    trainer(devices=1, num_nodes=2).fit(Net(), loader())

"""A divergence across nodes: two nodes of one rank each, rank 1 (node 1) logs a key with ``sync_dist=True`` that
rank 0 does not (Lightning#19106), over the namespace nodes of nodes/cluster.sh."""

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=1, line='self.log("rare_metric", loss, sync_dist=True)', cause="sync_dist keys", certain=True)
NODES = (0, 1)


class Case(Net):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("loss", loss, sync_dist=True)
        if self.global_rank == 1 and self.global_step == 3:
            hang_starts()
            self.log("rare_metric", loss, sync_dist=True)
        return loss


if __name__ == "__main__":
    trainer(devices=1, num_nodes=2).fit(Case(), loader())

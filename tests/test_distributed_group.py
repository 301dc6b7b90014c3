"""The process group's checkpoints in one process: what a rank raises when another failed or died."""
import pytest
import torch

from parity.base.errors import EXIT_USAGE, SubjectError, UsageError, classify
from parity.distributed.group import Group, RankFailed

GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:3459: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application.")


class FakeGroup(Group):
    """Rank 0 of 2 whose all-gather returns ``statuses`` or, with ``dead``, breaks as gloo's does."""

    def __init__(self, statuses=None, dead=False):
        super().__init__(rank=0, world_size=2, device=torch.device("cpu"), backend="gloo", owned=False)
        self.statuses, self.dead = statuses, dead

    def gather(self, value, *, step="a gather"):
        if self.dead:
            raise self.broken(RuntimeError(GLOO_RESET), step)
        return [value, *(self.statuses or [None])]


def test_a_dead_rank_breaks_the_group_into_one_usage_line():
    with pytest.raises(RankFailed) as caught:
        FakeGroup(dead=True).agree(None, "the recorded run")
    code, _, message = classify(caught.value)
    assert code == EXIT_USAGE
    assert message == ("rank 0 of 2: the process group broke during the recorded run: another rank exited or stopped "
                       "answering (gloo: Read error [127.0.0.1]:3459: Connection reset by peer)")
    # this rank's subject code failed in a collective because of the dead rank: the broken group is the cause
    own = SubjectError("dist_subject:TPDecoderSubject", "call", RuntimeError(GLOO_RESET))
    with pytest.raises(RankFailed, match="the process group broke during the recorded run"):
        FakeGroup(dead=True).agree(own, "the recorded run")
    # a usage error of this rank's own stays its own
    with pytest.raises(UsageError, match="^bad argument$"):
        FakeGroup(dead=True).agree(UsageError("bad argument"), "the recorded run")


def test_another_rank_s_failure_is_named_and_an_own_error_raised():
    with pytest.raises(RankFailed, match="^rank 1 of 2 failed during writing: disk full$"):
        FakeGroup(statuses=[(2, "disk full")]).agree(None, "writing")
    with pytest.raises(UsageError, match="^mine$"):
        FakeGroup(statuses=[(2, "theirs")]).agree(UsageError("mine"), "writing")
    FakeGroup(statuses=[None]).agree(None, "writing")  # every rank succeeded

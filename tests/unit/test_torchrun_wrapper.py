"""megabam/parallel/torchrun.py: torchrun's failure report is dropped only when every failed rank
already said why (a megabam exit code), or died of the SIGTERM torchrun sent it after another's."""

import pytest
import torch.distributed.run as run
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from megabam.parallel import torchrun


@pytest.mark.parametrize(
    "codes, quiet",
    [
        ([2, 2], True),
        ([2, -15], True),  # the other rank, stopped by torchrun before it installed its handler
        ([75, 130, 3], True),
        ([1, 2], False),  # a traceback's exit 1 beside a refusal: the report stays
        ([-9, 2], False),  # killed (the OOM killer?)
        ([-15, -15], False),  # a signal nobody explained
        ([-11], False),
    ],
)
def test_the_report_is_dropped_only_when_the_ranks_explained_the_failure(monkeypatch, codes, quiet):
    failures = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=c, error_file="") for r, c in enumerate(codes)}

    def failing_torchrun():
        raise ChildFailedError("megabam.cli", failures)

    monkeypatch.setattr(run, "main", failing_torchrun)
    if quiet:
        assert torchrun.main() == 1
    else:
        with pytest.raises(ChildFailedError):
            torchrun.main()

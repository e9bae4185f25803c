"""`elastic run --inject` refuses bad values with one clear line (exit code 2) before starting anything."""

from __future__ import annotations

import pytest

from elastic.cli.main import main

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--inject", "explode:node=1,step=2"], "KIND one of kill, hang, rejoin"),
        (["--inject", "kill:node=7,step=2"], "node 7 is not in the run"),
        (["--inject", "kill:node=1,step=99"], "past the last step 10"),
        (["--inject", "rejoin:node=1,step=3"], "that no injection fails first"),
        (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0"),
        (["--lease-ttl", "1"], "--lease-ttl must be >= 2"),
        (["--static", "--inject", "kill:node=1,step=2"], "--static runs without the control plane"),
    ],
)
def test_bad_injections_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    code = main(["run", "--nodes", "4", "--fault-tolerance", "1", "--run-dir", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err

"""`velox transfer ...` reaches velox-transfer's command line."""

import pytest

from velox_cli.main import main


def test_velox_transfer_dispatches_to_velox_transfer(capsys):
    with pytest.raises(SystemExit) as e:
        main(["transfer", "fit", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--source" in out and "--target" in out
    with pytest.raises(SystemExit) as e:  # its own argument errors: argparse's exit code 2
        main(["transfer", "apply", "--mapper", "/nonexistent/mapper"])
    assert e.value.code == 2 and "--source" in capsys.readouterr().err

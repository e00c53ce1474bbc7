"""The check of bad input the CLI tests share: ``velox`` refuses it in one line."""

import pytest

from velox_cli.main import main


def assert_refused(argv: list[str], needle: str, capsys) -> None:
    """``velox argv`` exits with code 2 (returned or raised) and writes one line to stderr that
    holds ``needle``, no traceback."""
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err

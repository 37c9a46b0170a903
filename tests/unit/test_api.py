"""bundle.api.train from a script: a call at its top level outside ``if __name__ == "__main__":``
is refused before anything starts (every process of the job imports the script again)."""

from __future__ import annotations

import runpy

import pytest

from bundle import api, cli
from bundle.errors import LaunchError

CALL = 'train("mlp", itr=1, no_eval=True)\n'


@pytest.fixture
def launched(monkeypatch):
    """What main.py would have run, recorded instead of run."""
    runs: list[list[str]] = []
    monkeypatch.setattr(cli, "main", lambda argv: runs.append(argv) or 0)
    return runs


def run(tmp_path, body: str) -> None:
    script = tmp_path / "job.py"
    script.write_text("from bundle.api import train\n" + body)
    runpy.run_path(str(script), run_name="__main__")


def test_a_call_outside_the_main_guard_is_refused_naming_its_line(tmp_path, launched):
    with pytest.raises(LaunchError) as err:
        run(tmp_path, "x = 1\n" + CALL)
    assert str(err.value).startswith(f"{tmp_path / 'job.py'}:3 runs bundle.api.train outside")
    assert "\n" not in str(err.value) and launched == []
    with pytest.raises(LaunchError, match=r"job.py:4 runs"):
        run(tmp_path, "def main():\n    " + CALL + "main()\n")  # through a function


@pytest.mark.parametrize(
    "body",
    [
        'if __name__ == "__main__":\n    ' + CALL,
        "if '__main__' == __name__:\n    x = 2\n    " + CALL,
        "def main():\n    " + CALL + 'if __name__ == "__main__":\n    main()\n',
    ],
)
def test_a_guarded_call_or_one_from_a_function_runs(tmp_path, launched, body):
    run(tmp_path, body)
    assert len(launched) == 1


def test_a_module_imported_by_name_is_not_a_script(launched):
    import sys

    api.check_guarded(sys._getframe(0))  # a test function's frame: nothing to refuse

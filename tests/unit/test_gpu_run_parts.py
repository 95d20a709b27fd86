"""tools/gpu_run.sh's TESTS_PART splits the GPU suite into two calls that together run every file.

Part 1 is tests/gpu less the slow fp32 attention files, part 2 those files; a file renamed or
removed would leave part 2 naming nothing (pytest stops on a missing path) or part 1 running it
twice, so the names are checked against the tree.  Control: a part other than 1 or 2 is refused."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_run.sh"


def _parts_block() -> str:
    text = SCRIPT.read_text()
    match = re.search(r"^SLOW_GPU_TESTS=.*?^esac$", text, flags=re.S | re.M)
    assert match, "tools/gpu_run.sh no longer defines SLOW_GPU_TESTS and its TESTS_PART case"
    return match.group(0)


def _tests_for(part: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", _parts_block() + '\necho "$TESTS"'], cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "TESTS": "tests/gpu", "TESTS_PART": part},
                          capture_output=True, text=True)


def test_the_two_parts_name_existing_files_and_together_cover_the_suite():
    first, second = (_tests_for(p) for p in ("1", "2"))
    assert first.returncode == 0 and second.returncode == 0, (first.stderr, second.stderr)
    ignored = [a.removeprefix("--ignore=") for a in first.stdout.split() if a.startswith("--ignore=")]
    assert first.stdout.split()[0] == "tests/gpu"
    slow = second.stdout.split()
    assert slow and sorted(ignored) == sorted(slow), (ignored, slow)
    for path in slow:
        assert (ROOT / path).is_file(), f"{path}: named by TESTS_PART but not in the tree"


def test_a_part_other_than_1_or_2_is_refused():
    result = _tests_for("3")
    assert result.returncode == 2 and "TESTS_PART is 1 or 2" in result.stdout, result

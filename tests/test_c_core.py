"""The C core's own unit tests (csrc/tests), built with CMake under
AddressSanitizer and UBSan and run through CTest. test_gguf also opens the
GGUF files linked into $EDGESPEC_TEST_MODELS_DIR (test_engine runs them): the
built-in models and the tiny llama and qwen2."""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_c_unit_tests_pass_under_sanitizers(tmp_path, smollm2_path, gemma_path, tiny_llama_path,
                                             tiny_qwen2_path):
    models = tmp_path / "models"
    models.mkdir()
    for path in (smollm2_path, gemma_path, tiny_llama_path, tiny_qwen2_path):
        (models / pathlib.Path(path).name).symlink_to(path)
    cmake = shutil.which("cmake")
    assert cmake, "cmake is a build requirement of edgespec"
    build = tmp_path / "build"
    subprocess.run([cmake, "-S", str(ROOT), "-B", str(build), "-DEDGESPEC_SANITIZE=ON",
                    "-DCMAKE_BUILD_TYPE=Debug"], check=True, capture_output=True)
    subprocess.run([cmake, "--build", str(build), "-j2"], check=True, capture_output=True)
    ctest = subprocess.run(["ctest", "--test-dir", str(build), "--output-on-failure"],
                           capture_output=True, text=True,
                           env={**os.environ, "EDGESPEC_TEST_MODELS_DIR": str(models)})
    assert ctest.returncode == 0, ctest.stdout + ctest.stderr
    ran = re.search(r"100% tests passed(?:, 0 tests failed)? out of (\d+)", ctest.stdout)
    programs = sorted(p.stem for p in (ROOT / "csrc" / "tests").glob("test_*.c"))
    assert ran and int(ran.group(1)) == len(programs), ctest.stdout  # every one of them ran
    for name in programs:
        assert re.search(rf"Test +#\d+: {name} \.+ +Passed", ctest.stdout), (name, ctest.stdout)

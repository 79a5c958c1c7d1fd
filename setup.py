"""One thing pyproject.toml cannot say: install ``kvcal-lm-eval.pth`` at the top of site-packages.

That file imports ``kvcal_lm_eval_plugin`` at interpreter start-up so that ``lm_eval --model kvcal``
resolves (the plugin's docstring says why lm-eval needs it). A regular wheel gets it from
``build_py`` (the wheel's root is site-packages); an editable install (``pip install -e .``,
PEP 660) from ``editable_wheel``, whose wheel holds no files of ``build_py``'s.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "kvcal-lm-eval.pth"
HERE = Path(__file__).resolve().parent


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(str(HERE / PTH), str(Path(self.build_lib) / PTH))


class EditableWheelWithPth(editable_wheel):
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        outputs = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        shutil.copyfile(HERE / PTH, Path(unpacked_wheel) / PTH)
        return outputs


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})

"""The package as users get it: the wheel and the sdist hold every module of the tree, and say what they are.
(.ci/check-wheel installs the wheel alone in a fresh venv and trains with it from outside the checkout.)"""
import email
import os
import subprocess
import sys
import tarfile
import zipfile

import pytest

from helpers import source_copy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("estimator", "store")


def tree_modules():
    found = set()
    for package in PACKAGES:
        for folder, dirs, names in os.walk(os.path.join(ROOT, package)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            found |= {os.path.relpath(os.path.join(folder, n), ROOT).replace(os.sep, "/") for n in names
                      if n.endswith(".py")}
    return found


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """sdist, then the wheel built from that sdist (python -m build's default), as users' installers do."""
    out = tmp_path_factory.mktemp("dist")
    source = source_copy(ROOT, tmp_path_factory.mktemp("source"))  # no egg-info or build/ left by earlier builds
    result = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), source],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    wheel = next(out.glob("*.whl"))
    sdist = next(out.glob("*.tar.gz"))
    return wheel, sdist


def test_the_wheel_holds_every_module_of_the_tree(built):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    modules = {n for n in names if n.endswith(".py")}
    assert modules == tree_modules()
    assert "estimator/data/__init__.py" in modules  # the subpackage an earlier wheel lacked
    assert not [n for n in names if n.split("/")[0] == "tests"]


def test_the_sdist_holds_every_module_and_what_builds_it(built):
    _, sdist = built
    with tarfile.open(sdist) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    assert tree_modules() <= names
    assert {"setup.cfg", "pyproject.toml", "README.md"} <= names


def test_the_wheel_metadata(built):
    import estimator

    wheel, _ = built
    with zipfile.ZipFile(wheel) as archive:
        meta_name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(archive.read(meta_name))
    assert meta["Name"] == "spark-torch-estimator"
    assert meta["Version"] == estimator.__version__
    assert meta["Requires-Python"] == ">=3.10"
    classifiers = meta.get_all("Classifier")
    assert {f"Programming Language :: Python :: 3.{minor}" for minor in (10, 11, 12, 13)} <= set(classifiers)
    requires = {r.split(";")[0].split(">")[0].split("<")[0].split("=")[0].strip() for r in meta.get_all("Requires-Dist")
                if "extra ==" not in r}
    assert {"pyspark", "torch", "pyarrow", "numpy", "pandas", "fsspec", "cloudpickle", "tqdm"} <= requires
    assert "# spark-torch-estimator" in meta.get_payload()  # the README is the long description


def test_the_zip_shipped_to_executors_holds_the_packages_without_the_driver_only_helpers():
    import zipfile

    from estimator.launch.shipping import package_zip

    names = zipfile.ZipFile(package_zip()).namelist()
    assert {"estimator/launch/spark.py", "estimator/launch/rank_setup.py", "estimator/data/feed.py", "store/store.py"} <= set(names)
    assert "estimator/cluster.py" not in names  # local Spark servers for examples and tests: the driver's only


def test_the_files_a_driver_writes_to_ship_are_removed_when_it_exits_and_not_by_a_forked_child(tmp_path):
    """The package zip and a transform's pickled model lie in the temp dir while the driver's sessions may read
    them; they once stayed there for good (hundreds of MB per model). A forked child that exits normally (its
    atexit handlers run) leaves its parent's files."""
    script = (
        "import os, sys\n"
        "from estimator.launch.shipping import package_zip, temporary_file\n"
        "paths = [package_zip(), temporary_file('spark-torch-estimator-models', 'torch-model-x.pkl', b'x' * 100)]\n"
        "assert temporary_file('spark-torch-estimator-models', 'torch-model-x.pkl', b'') == paths[1]  # once\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    sys.exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "assert all(os.path.exists(p) for p in paths), 'removed by the child'\n"
        "print('\\n'.join(paths))\n")
    env = dict(os.environ, TMPDIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr[-3000:]
    paths = result.stdout.split()
    assert len(paths) == 2 and all(p.startswith(str(tmp_path)) for p in paths), paths
    assert not [p for p in paths if os.path.exists(p)]  # gone with the driver
    assert not [n for d in tmp_path.iterdir() for n in os.listdir(d)]

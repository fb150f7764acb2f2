"""Checks scripts/spack/packages/kokkosmoe/package.py without Spack: the file
compiles, loads against a recording stand-in for spack.package, has the
variants cuda, nccl, hdf5, python and fortran, and every CMake option its
cmake_args() defines (for a CUDA spec with every variant on) is a cache
option of the project's CMakeLists.txt.

    python3 check_spack_package.py <source folder>
"""

import importlib.util
import re
import sys
import types

sys.dont_write_bytecode = True  # nothing written next to the package

source = sys.argv[1]
path = f"{source}/scripts/spack/packages/kokkosmoe/package.py"
compile(open(path).read(), path, "exec")  # a syntax error raises here

recorded = {"variant": [], "depends_on": [], "version": []}


def directive(kind):
    def record(*args, **kwargs):
        recorded[kind].append((args, kwargs))
    return record


class Spec:
    """A spec with every variant on, CUDA included."""

    def satisfies(self, constraint):
        return True

    def __getitem__(self, name):
        return types.SimpleNamespace(prefix=f"/opt/{name}", kokkos_cxx="/opt/kokkos/bin/nvcc_wrapper",
                                     command=types.SimpleNamespace(path="/usr/bin/python3"),
                                     version=types.SimpleNamespace(up_to=lambda n: "3.11"))


class Package:
    run_tests = True

    def __init__(self):
        self.spec = Spec()

    def define(self, name, value):
        value = ("ON" if value else "OFF") if isinstance(value, bool) else value
        return f"-D{name}={value}"

    def define_from_variant(self, name, variant):
        return self.define(name, True)


class CudaPackage:
    cuda_arch_values = ("80", "90")


stub = types.ModuleType("spack.package")
for kind in recorded:
    setattr(stub, kind, directive(kind))
stub.license = lambda *a, **k: None
stub.CMakePackage = Package
stub.CudaPackage = CudaPackage
stub.join_path = lambda *parts: "/".join(parts)
stub.working_dir = None
stub.ctest = None
sys.modules["spack"] = types.ModuleType("spack")
sys.modules["spack.package"] = stub

spec = importlib.util.spec_from_file_location("kokkosmoe_spack_package", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)

variants = {args[0] for args, _ in recorded["variant"]} | {"cuda"}  # cuda: from CudaPackage
missing = {"cuda", "nccl", "hdf5", "python", "fortran"} - variants
assert not missing, f"package.py lacks the variants {sorted(missing)}"
assert recorded["version"], "package.py declares no version"

cmake_text = open(f"{source}/CMakeLists.txt").read()
options = set(re.findall(r"(?:option|set)\((KokkosMoE_\w+)", cmake_text))
args = module.Kokkosmoe().cmake_args()
for arg in args:
    name = arg[2:].split("=", 1)[0]
    if name.startswith("KokkosMoE_"):
        assert name in options, f"package.py sets {name}, which CMakeLists.txt does not define"
print(f"spack package ok: variants {sorted(variants)}; {len(args)} CMake arguments")

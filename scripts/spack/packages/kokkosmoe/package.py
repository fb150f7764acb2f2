# Spack package of KokkosMoE, kept with the sources it builds: the default
# version is the checkout this file lives in (scripts/spack/packages/kokkosmoe
# is four folders below its root), so `spack repo add scripts/spack` followed
# by `spack install kokkosmoe` builds what is checked out. A site mirroring
# the repository sets KOKKOSMOE_GIT to its own URL.
import os

from spack.package import *

_CHECKOUT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))


class Kokkosmoe(CMakePackage, CudaPackage):
    """Portable expert-parallel Mixture-of-Experts layers on Kokkos, Kokkos
    Kernels, MPI, NCCL and hwloc: routing, token permutation, grouped expert
    GEMM and hierarchical exchanges, with C, Fortran and Python interfaces."""

    homepage = "file://" + _CHECKOUT
    git = os.environ.get("KOKKOSMOE_GIT", "file://" + _CHECKOUT)

    license("BSD-3-Clause")

    version("main", branch="main")

    variant("kokkos_kernels", default=True, description="BLAS/cuBLAS paths through Kokkos Kernels")
    variant("hdf5", default=True, description="Parallel HDF5 for weights, placements and step reports")
    variant("nccl", default=True, when="+cuda", description="NCCL transport for the exchanges")
    variant("cublas", default=True, when="+cuda", description="cuBLAS grouped expert GEMM (CUDA >= 12.5)")
    variant("fortran", default=True, description="Fortran module kokkosmoe (over the C interface)")
    variant("python", default=False, description="Python module kokkosmoe (pybind11, NumPy)")
    variant("apps", default=True, description="The kmoe-* mini-apps and kmoe-bench")

    depends_on("c", type="build")
    depends_on("cxx", type="build")
    depends_on("fortran", type="build", when="+fortran")
    depends_on("cmake@3.16:", type="build")
    depends_on("pkgconfig", type="build")

    depends_on("mpi")
    depends_on("hwloc@2:")
    depends_on("kokkos@3.4:")
    depends_on("kokkos@4:+cuda+cuda_lambda+wrapper", when="+cuda")
    depends_on("kokkos-kernels@3.4:", when="+kokkos_kernels")
    depends_on("kokkos-kernels+cublas", when="+kokkos_kernels+cuda")
    depends_on("hdf5+mpi", when="+hdf5")
    depends_on("nccl", when="+nccl")
    depends_on("cuda@12.5:", when="+cublas")
    depends_on("tomlplusplus")
    depends_on("nlohmann-json@3.9:")
    depends_on("cli11", when="+apps")

    depends_on("python@3.8:", when="+python", type=("build", "link", "run"))
    depends_on("py-pybind11@2.6:", when="+python", type="build")
    depends_on("py-numpy", when="+python", type="run")
    depends_on("py-mpi4py", when="+python", type="run")

    depends_on("catch2@2.13:", type="test")

    # The same Kokkos for every package of the build.
    for _arch in CudaPackage.cuda_arch_values:
        depends_on(f"kokkos cuda_arch={_arch}", when=f"+cuda cuda_arch={_arch}")

    def cmake_args(self):
        spec = self.spec
        on_off = lambda v: "ON" if spec.satisfies(f"+{v}") else "OFF"
        args = [
            self.define("Kokkos_ROOT", spec["kokkos"].prefix),
            self.define("KokkosMoE_ENABLE_KOKKOSKERNELS", on_off("kokkos_kernels")),
            self.define_from_variant("KokkosMoE_ENABLE_HDF5", "hdf5"),
            self.define("KokkosMoE_ENABLE_NCCL", on_off("nccl")),
            self.define("KokkosMoE_ENABLE_CUBLAS", on_off("cublas")),
            self.define("KokkosMoE_ENABLE_BINDINGS", "ON"),
            self.define("KokkosMoE_ENABLE_FORTRAN", on_off("fortran")),
            self.define("KokkosMoE_ENABLE_PYTHON", on_off("python")),
            self.define_from_variant("KokkosMoE_ENABLE_APPS", "apps"),
            self.define("KokkosMoE_ENABLE_TESTS", self.run_tests),
        ]
        if spec.satisfies("+kokkos_kernels"):
            args.append(self.define("KokkosKernels_ROOT", spec["kokkos-kernels"].prefix))
        if spec.satisfies("+cuda"):
            args.append(self.define("CMAKE_CXX_COMPILER", spec["kokkos"].kokkos_cxx))
        if spec.satisfies("+python"):
            args.append(self.define("Python3_EXECUTABLE", spec["python"].command.path))
        return args

    def setup_run_environment(self, env):
        if self.spec.satisfies("+python"):
            env.prepend_path("PYTHONPATH", join_path(self.prefix.lib, f"python{self.spec['python'].version.up_to(2)}",
                                                     "site-packages"))

    def check(self):
        with working_dir(self.build_directory):
            ctest("--output-on-failure", "-L", "unit")

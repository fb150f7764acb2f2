// _kokkosmoe: the Python module of KokkosMoE over the C interface (kmoe.h).
// NumPy arrays go to the library in place (the buffer protocol: C-contiguous
// float32 rows, or uint16 rows holding bf16 bits); a failed call raises
// kokkosmoe.Error with the library's message and status, the same on every
// rank for collective calls. kokkosmoe/__init__.py is the public face.

#include <kmoe.h>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

py::object error_type;  // kokkosmoe.Error, set by __init__.py

void check(kmoe_status st) {
  if (st == KMOE_SUCCESS) return;
  std::string const message = kmoe_last_error();
  if (error_type) {
    py::object e = error_type(message, static_cast<int>(st));
    PyErr_SetObject(error_type.ptr(), e.ptr());
    throw py::error_already_set();
  }
  throw std::runtime_error(message);
}

/// MPI_COMM_WORLD, or the communicator of an mpi4py Comm (through its
/// Fortran handle, py2f()).
MPI_Fint fortran_comm(py::object const& comm) {
  if (comm.is_none()) return MPI_Comm_c2f(MPI_COMM_WORLD);
  if (!py::hasattr(comm, "py2f")) throw py::type_error("comm: an mpi4py communicator (with py2f()) or None");
  return comm.attr("py2f")().cast<MPI_Fint>();
}

class Layer {
 public:
  static Layer from_deck(std::string const& path, py::object const& comm) {
    Layer l;
    MPI_Fint const f = fortran_comm(comm);
    check(kmoe_layer_create_from_deck_f(path.c_str(), f, &l.h_));
    return l;
  }
  static Layer from_config(py::dict const& kw, py::object const& comm) {
    kmoe_layer_config c = kmoe_layer_config_default();
    std::string algorithm = "flat", transport = "mpi", score = "softmax", payload, return_payload;
    for (auto const& item : kw) {
      std::string const k = item.first.cast<std::string>();
      py::handle v = item.second;
      if (k == "hidden") c.hidden = v.cast<std::int64_t>();
      else if (k == "experts") c.experts = v.cast<std::int32_t>();
      else if (k == "top_k") c.top_k = v.cast<std::int32_t>();
      else if (k == "ffn") c.ffn = v.cast<std::int64_t>();
      else if (k == "shared_experts") c.shared_experts = v.cast<std::int32_t>();
      else if (k == "tokens_per_rank") c.tokens_per_rank = v.cast<std::int64_t>();
      else if (k == "nodes") c.nodes = v.cast<std::int32_t>();
      else if (k == "seed") c.seed = v.cast<std::uint64_t>();
      else if (k == "algorithm") algorithm = v.cast<std::string>();
      else if (k == "transport") transport = v.cast<std::string>();
      else if (k == "score") score = v.cast<std::string>();
      else if (k == "payload") payload = v.cast<std::string>();
      else if (k == "return_payload") return_payload = v.cast<std::string>();
      else if (k == "dtype") {
        std::string const t = v.cast<std::string>();
        if (t != "fp32" && t != "bf16") throw py::value_error("dtype: 'fp32' or 'bf16', not '" + t + "'");
        c.dtype = t == "bf16" ? KMOE_BF16 : KMOE_FP32;
      } else
        throw py::type_error("Layer: unknown keyword '" + k + "'");
    }
    c.algorithm = algorithm.c_str();
    c.transport = transport.c_str();
    c.score = score.c_str();
    c.payload = payload.empty() ? nullptr : payload.c_str();
    c.return_payload = return_payload.empty() ? nullptr : return_payload.c_str();
    Layer l;
    check(kmoe_layer_create_f(&c, fortran_comm(comm), &l.h_));
    return l;
  }

  Layer() = default;
  Layer(Layer const&) = delete;
  Layer(Layer&& o) noexcept : h_(o.h_) { o.h_ = nullptr; }
  ~Layer() {
    if (h_ && kmoe_is_initialized()) kmoe_layer_destroy(h_);
  }

  /// Collective: frees the layer now (the destructor does it otherwise).
  void close() {
    if (!h_) return;
    kmoe_layer* h = h_;
    h_ = nullptr;
    check(kmoe_layer_destroy(h));
  }

  py::dict shape() const {
    std::int64_t hidden = 0, tokens = 0;
    std::int32_t experts = 0, top_k = 0;
    kmoe_dtype dtype = KMOE_FP32;
    check(kmoe_layer_shape(handle(), &hidden, &experts, &top_k, &dtype, &tokens));
    py::dict d;
    d["hidden"] = hidden;
    d["experts"] = experts;
    d["top_k"] = top_k;
    d["dtype"] = dtype == KMOE_BF16 ? "bf16" : "fp32";
    d["tokens_per_rank"] = tokens;
    return d;
  }

  /// Collective: the layer on this rank's rows [tokens, hidden] (float32, or
  /// uint16 bf16 bits); the result into `out` (same shape and dtype) or a new
  /// array.
  py::array forward(py::array hidden, std::optional<py::array> out) {
    kmoe_dtype const dt = layer_dtype();
    std::string problem;
    bool const f32 = hidden.dtype().is(py::dtype::of<float>());
    bool const u16 = hidden.dtype().is(py::dtype::of<std::uint16_t>());
    if (!(hidden.flags() & py::array::c_style)) problem = "forward: hidden must be C-contiguous";
    else if (hidden.ndim() != 2) problem = "forward: hidden must be 2-D [tokens, hidden], it has " + std::to_string(hidden.ndim()) + " dimensions";
    else if (!f32 && !u16) problem = "forward: hidden must be float32 (fp32) or uint16 (bf16 bits), not " + py::str(hidden.dtype()).cast<std::string>();
    else if ((dt == KMOE_BF16) != u16) problem = std::string("forward: the layer computes in ") + (dt == KMOE_BF16 ? "bf16 (uint16 arrays)" : "fp32 (float32 arrays)");
    if (problem.empty()) {
      if (!out) out = py::array(hidden.dtype(), std::vector<py::ssize_t>{hidden.shape(0), hidden.shape(1)});
      else if (!out->dtype().is(hidden.dtype()) || out->ndim() != 2 || out->shape(0) != hidden.shape(0) ||
               out->shape(1) != hidden.shape(1) || !(out->flags() & py::array::c_style) || !out->writeable())
        problem = "forward: out must be a writeable C-contiguous array of hidden's shape and dtype";
    }
    // Every rank agrees on the arguments before the collective forward.
    check(kmoe_layer_check(handle(), problem.empty() ? 1 : 0, problem.c_str()));
    std::int64_t const T = hidden.shape(0), d = hidden.shape(1);
    void* o = out->mutable_data();
    void const* h = hidden.data();
    kmoe_layer* const layer = handle();
    kmoe_status st;
    {
      py::gil_scoped_release release;  // other Python threads run meanwhile
      st = kmoe_layer_forward(layer, h, T, d, dt, KMOE_HOST, o);
    }
    check(st);  // raises with the GIL held
    return *out;
  }

  /// Collective: the backward of the last forward (on `hidden`): the
  /// gradient with respect to hidden, given dout (fp32 layers, float32 rows).
  py::array backward(py::array hidden, py::array dout) {
    std::string problem;
    auto ok = [](py::array const& a) {
      return a.dtype().is(py::dtype::of<float>()) && a.ndim() == 2 && (a.flags() & py::array::c_style);
    };
    if (!ok(hidden) || !ok(dout)) problem = "backward: hidden and dout must be C-contiguous 2-D float32 arrays";
    else if (hidden.shape(0) != dout.shape(0) || hidden.shape(1) != dout.shape(1)) problem = "backward: hidden and dout differ in shape";
    check(kmoe_layer_check(handle(), problem.empty() ? 1 : 0, problem.c_str()));
    py::array dx(hidden.dtype(), std::vector<py::ssize_t>{hidden.shape(0), hidden.shape(1)});
    kmoe_layer* const layer = handle();
    void const* h = hidden.data();
    void const* g = dout.data();
    void* x = dx.mutable_data();
    std::int64_t const T = hidden.shape(0), d = hidden.shape(1);
    kmoe_status st;
    {
      py::gil_scoped_release release;
      st = kmoe_layer_backward(layer, h, g, T, d, KMOE_FP32, KMOE_HOST, x);
    }
    check(st);
    return dx;
  }

  double gradient_norm() {
    double n = 0;
    check(kmoe_layer_gradient_norm(handle(), &n));
    return n;
  }

  /// This rank's rows of step `step` of the deck (router-sourced decks).
  py::array deck_rows(int step) const {
    auto const s = shape();
    std::int64_t const T = s["tokens_per_rank"].cast<std::int64_t>(), d = s["hidden"].cast<std::int64_t>();
    py::array rows = layer_dtype() == KMOE_BF16 ? py::array(py::dtype::of<std::uint16_t>(), std::vector<py::ssize_t>{T, d})
                                                : py::array(py::dtype::of<float>(), std::vector<py::ssize_t>{T, d});
    check(kmoe_layer_deck_rows(handle(), step, rows.mutable_data(), T, d));
    return rows;
  }

  /// Collective: the content digest of every rank's rows (rank order).
  std::string digest(py::array rows) {
    std::string problem;
    if (rows.ndim() != 2 || !(rows.flags() & py::array::c_style)) problem = "digest: a C-contiguous 2-D array";
    check(kmoe_layer_check(handle(), problem.empty() ? 1 : 0, problem.c_str()));
    char d[17];
    check(kmoe_layer_digest(handle(), rows.data(), rows.shape(0), rows.shape(1), d));
    return d;
  }

  std::string last_step_json() const { return text([&](char* b, size_t n, size_t* need) { return kmoe_layer_last_step_json(handle(), b, n, need); }); }
  std::string topology_json() const { return text([&](char* b, size_t n, size_t* need) { return kmoe_layer_topology_json(handle(), b, n, need); }); }

  py::tuple placement() const {
    std::int32_t n = 0;
    check(kmoe_layer_placement(handle(), nullptr, nullptr, 0, &n));
    py::array_t<std::int32_t> e(n), r(n);
    check(kmoe_layer_placement(handle(), e.mutable_data(), r.mutable_data(), n, &n));
    return py::make_tuple(e, r);
  }

  void save_weights(std::string const& path) { check(kmoe_layer_save_weights(handle(), path.c_str())); }
  void load_weights(std::string const& path) { check(kmoe_layer_load_weights(handle(), path.c_str())); }

  /// The kmoe_parameter called `name`.
  static kmoe_parameter parameter_named(std::string const& name) {
    for (int p = KMOE_ROUTER_WEIGHT; p <= KMOE_SHARED_DOWN; ++p)
      if (name == kmoe_parameter_name(static_cast<kmoe_parameter>(p))) return static_cast<kmoe_parameter>(p);
    std::string known;
    for (int p = KMOE_ROUTER_WEIGHT; p <= KMOE_SHARED_DOWN; ++p) known += std::string(p ? ", " : "") + kmoe_parameter_name(static_cast<kmoe_parameter>(p));
    throw py::value_error("unknown parameter '" + name + "' (parameters: " + known + ")");
  }

  int parameter_count(std::string const& name) const {
    std::int32_t n = 0;
    check(kmoe_layer_parameter_info(handle(), parameter_named(name), &n, nullptr, nullptr));
    return n;
  }

  std::vector<py::ssize_t> parameter_shape(std::string const& name) const {
    std::int32_t nd = 0;
    std::int64_t s[2] = {0, 0};
    check(kmoe_layer_parameter_info(handle(), parameter_named(name), nullptr, &nd, s));
    return std::vector<py::ssize_t>(s, s + nd);
  }

  /// Collective: one tensor of a parameter as a new float32 array.
  py::array_t<float> get_parameter(std::string const& name, int index) {
    kmoe_parameter const p = parameter_named(name);
    py::array_t<float> v(parameter_shape(name));
    check(kmoe_layer_get_parameter(handle(), p, index, v.mutable_data(), static_cast<std::int64_t>(v.size())));
    return v;
  }

  /// Collective: sets one tensor (values: anything float32-convertible of
  /// its shape; None on ranks that hold no copy of a routed expert).
  void set_parameter(std::string const& name, int index, py::object values) {
    kmoe_parameter const p = parameter_named(name);
    py::array_t<float, py::array::c_style | py::array::forcecast> v;
    std::string problem;
    if (!values.is_none()) v = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(values);
    if (values.is_none()) problem.clear();
    else if (!v) problem = "set_parameter: values must be convertible to a float32 array";
    else if (v.ndim() != static_cast<py::ssize_t>(parameter_shape(name).size()) ||
             !std::equal(v.shape(), v.shape() + v.ndim(), parameter_shape(name).begin()))
      problem = "set_parameter: " + name + " tensors are " + py::str(py::tuple(py::cast(parameter_shape(name)))).cast<std::string>() +
                ", values are " + py::str(py::tuple(py::cast(std::vector<py::ssize_t>(v.shape(), v.shape() + v.ndim())))).cast<std::string>();
    // Every rank agrees on the arguments (a rank passing None included).
    check(kmoe_layer_check(handle(), problem.empty() ? 1 : 0, problem.c_str()));
    if (values.is_none())
      check(kmoe_layer_set_parameter(handle(), p, index, nullptr, 0));
    else
      check(kmoe_layer_set_parameter(handle(), p, index, v.data(), static_cast<std::int64_t>(v.size())));
  }

  /// Collective: the gradient of one tensor from the last backward.
  py::array_t<float> get_gradient(std::string const& name, int index) {
    kmoe_parameter const p = parameter_named(name);
    py::array_t<float> v(parameter_shape(name));
    check(kmoe_layer_get_gradient(handle(), p, index, v.mutable_data(), static_cast<std::int64_t>(v.size())));
    return v;
  }

  /// The global expert of each of this rank's routed slots.
  py::array_t<std::int32_t> local_experts() const {
    std::int32_t n = 0;
    check(kmoe_layer_local_experts(handle(), nullptr, 0, &n));
    py::array_t<std::int32_t> e(n);
    check(kmoe_layer_local_experts(handle(), e.mutable_data(), n, &n));
    return e;
  }

  /// This rank's storage of a parameter as an array over the layer's memory
  /// (no copy; `owner`, the Python layer, lives as long as the array).
  static py::array parameter_view(py::object owner, std::string const& name) {
    return storage_view(owner, name, false);
  }

  /// This rank's gradient storage of a parameter (float32, no copy), filled
  /// by each backward.
  static py::array gradient_view(py::object owner, std::string const& name) {
    return storage_view(owner, name, true);
  }

 private:
  /// An array over this rank's storage of a parameter (gradient: its fp32
  /// gradient storage), kept alive by `owner`.
  static py::array storage_view(py::object owner, std::string const& name, bool gradient) {
    Layer& self = owner.cast<Layer&>();
    void* data = nullptr;
    std::int32_t nd = 0;
    std::int64_t s[3] = {0, 0, 0};
    kmoe_dtype dt = KMOE_FP32;
    kmoe_memory mem = KMOE_HOST;
    if (gradient) {
      float* g = nullptr;
      check(kmoe_layer_gradient_storage(self.handle(), parameter_named(name), &g, &nd, s, &mem));
      data = g;
    } else {
      check(kmoe_layer_parameter_storage(self.handle(), parameter_named(name), &data, &nd, s, &dt, &mem));
    }
    if (mem != KMOE_HOST)
      throw py::value_error(std::string(gradient ? "gradient_view" : "parameter_view") + ": the layer's storage lives in device memory (use " +
                            (gradient ? "get_gradient" : "get_parameter") + ")");
    py::dtype const t = dt == KMOE_BF16 ? py::dtype::of<std::uint16_t>() : py::dtype::of<float>();
    return py::array(t, std::vector<py::ssize_t>(s, s + nd), data, owner);
  }

  kmoe_layer* handle() const {
    if (!h_) throw std::runtime_error("the layer is closed");
    return h_;
  }
  kmoe_dtype layer_dtype() const {
    kmoe_dtype dt = KMOE_FP32;
    check(kmoe_layer_shape(handle(), nullptr, nullptr, nullptr, &dt, nullptr));
    return dt;
  }
  template <class F>
  static std::string text(F&& f) {
    size_t need = 0;
    check(f(nullptr, 0, &need));
    std::string s(need, '\0');
    check(f(s.data(), s.size(), &need));
    s.resize(need - 1);
    return s;
  }

  kmoe_layer* h_ = nullptr;
};

}  // namespace

PYBIND11_MODULE(_kokkosmoe, m) {
  m.doc() = "KokkosMoE: expert-parallel Mixture-of-Experts layers (the C interface in Python)";
  m.def("_set_error_type", [](py::object t) { error_type = std::move(t); });
  m.def("initialize", [] { check(kmoe_initialize(nullptr, nullptr)); }, "MPI (unless started, e.g. by mpi4py) and Kokkos");
  m.def("finalize", [] { check(kmoe_finalize()); });
  m.def("is_initialized", [] { return kmoe_is_initialized() != 0; });
  m.def("version", [] { return std::string(kmoe_version()); });
  m.def("build_configuration_json", [] { return std::string(kmoe_build_configuration()); });
  m.def("eplb",
        [](py::array_t<double, py::array::c_style | py::array::forcecast> loads, int slots, int ranks, int nodes, int groups) {
          std::int32_t const E = static_cast<std::int32_t>(loads.size());
          py::array_t<std::int32_t> e(slots > 0 ? slots : 0), r(slots > 0 ? slots : 0);
          check(kmoe_eplb(loads.data(), E, slots, ranks, nodes, groups, e.mutable_data(), r.mutable_data()));
          return py::make_tuple(e, r);
        },
        py::arg("loads"), py::arg("slots"), py::arg("ranks"), py::arg("nodes") = 1, py::arg("groups") = 1);
  py::class_<Layer>(m, "Layer")
      .def_static("from_deck", &Layer::from_deck, py::arg("path"), py::arg("comm") = py::none())
      .def_static("from_config", &Layer::from_config, py::arg("config"), py::arg("comm") = py::none())
      .def("close", &Layer::close)
      .def_property_readonly("shape", &Layer::shape)
      .def("forward", &Layer::forward, py::arg("hidden"), py::arg("out") = py::none())
      .def("backward", &Layer::backward, py::arg("hidden"), py::arg("dout"))
      .def("gradient_norm", &Layer::gradient_norm)
      .def("deck_rows", &Layer::deck_rows, py::arg("step") = 0)
      .def("digest", &Layer::digest)
      .def("last_step_json", &Layer::last_step_json)
      .def("topology_json", &Layer::topology_json)
      .def("placement", &Layer::placement)
      .def("save_weights", &Layer::save_weights)
      .def("load_weights", &Layer::load_weights)
      .def("parameter_count", &Layer::parameter_count, py::arg("name"))
      .def("parameter_shape", &Layer::parameter_shape, py::arg("name"))
      .def("get_parameter", &Layer::get_parameter, py::arg("name"), py::arg("index") = 0)
      .def("set_parameter", &Layer::set_parameter, py::arg("name"), py::arg("index"), py::arg("values"))
      .def("get_gradient", &Layer::get_gradient, py::arg("name"), py::arg("index") = 0)
      .def("local_experts", &Layer::local_experts)
      .def("parameter_view", &Layer::parameter_view, py::arg("name"))
      .def("gradient_view", &Layer::gradient_view, py::arg("name"));
}

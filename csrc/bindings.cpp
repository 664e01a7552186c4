// The Python module elasticlab._C. Importing it loads the shared library, whose static initialisers register
// the operators with torch (torch.ops.elasticlab.*).
//
// It also holds direct calls of the fused layers' operators (linear_norms, conv_norms, layer_norm_norms,
// group_norm_norms), for the eager forward of every covered layer. torch.ops' Python entry converts each
// argument through the schema into a boxed stack (about 5 µs a call on the 2-core CPU box, as much as a small
// layer's GEMM); these read the arguments straight from the Python objects and call the operator's typed
// dispatcher handle, so every dispatch key (autograd, the profiler's record, Python dispatch modes) still
// applies. A tensor argument of a subclass (which may define __torch_function__; nn.Parameter does not count),
// or a torch function mode, or an argument of another type than the plain Python ones (a numpy scalar), sends
// the call to torch.ops' own entry instead, so both accept and reject the same calls. CPython's API and
// torch_python's tensor wrapping only (no pybind11 module).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include "ops.h"

#include <initializer_list>
#include <optional>
#include <vector>

namespace {

// Thrown by Args when an argument is not of the plain Python type the direct path reads (a numpy scalar, a
// 0-dim tensor for a float, a wrong type): the call then goes to torch.ops' entry, which converts what it can
// and raises its own error for the rest, so the direct calls accept and reject exactly what torch.ops does.
struct NotPlain {};

// The positional arguments of one call, read by schema type.
struct Args {
  PyObject* const* a;

  at::Tensor tensor(int i) const {
    if (!THPVariable_Check(a[i])) throw NotPlain{};
    return THPVariable_Unpack(a[i]);
  }
  std::optional<at::Tensor> opt_tensor(int i) const {
    if (a[i] == Py_None) return std::nullopt;
    return tensor(i);
  }
  static int64_t as_int(PyObject* o) {
    if (!PyLong_CheckExact(o)) throw NotPlain{};
    const int64_t v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();  // out of int64's range: torch.ops says so
      throw NotPlain{};
    }
    return v;
  }
  int64_t integer(int i) const { return as_int(a[i]); }
  double real(int i) const {
    if (PyFloat_CheckExact(a[i])) return PyFloat_AS_DOUBLE(a[i]);
    return static_cast<double>(as_int(a[i]));
  }
  bool flag(int i) const {
    if (!PyBool_Check(a[i])) throw NotPlain{};
    return a[i] == Py_True;
  }
  std::vector<int64_t> ints(int i) const {
    if (!PyTuple_CheckExact(a[i]) && !PyList_CheckExact(a[i])) throw NotPlain{};
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(a[i]);
    PyObject** items = PySequence_Fast_ITEMS(a[i]);
    std::vector<int64_t> out(n);
    for (Py_ssize_t k = 0; k < n; ++k) out[k] = as_int(items[k]);
    return out;
  }
  std::optional<at::ScalarType> opt_dtype(int i) const {
    if (a[i] == Py_None) return std::nullopt;
    if (!THPDtype_Check(a[i])) throw NotPlain{};
    return reinterpret_cast<THPDtype*>(a[i])->scalar_type;
  }
};

// The GIL released for the operator's run (and taken back on return or unwinding).
struct NoGil {
  PyThreadState* state = PyEval_SaveThread();
  NoGil() = default;
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;
  ~NoGil() { PyEval_RestoreThread(state); }
};

// torch.ops.elasticlab.<name>.default, looked up at first need (for the calls fast_call does not take).
PyObject* boxed_entry(const char* name) {
  PyObject* obj = PyImport_ImportModule("torch");
  for (const char* attr : {"ops", "elasticlab", name, "default"}) {
    if (obj == nullptr) return nullptr;
    PyObject* next = PyObject_GetAttrString(obj, attr);
    Py_DECREF(obj);
    obj = next;
  }
  return obj;
}

// Runs `call` (which reads the arguments, then runs the operator without the GIL) when the call is plain:
// the right count, exact tensors (nn.Parameter counts), no torch function mode, arguments of the types Args
// reads. Anything else goes to torch.ops' entry: subclasses' __torch_function__, conversions, errors.
template <class Call>
PyObject* fast_call(const char* name, PyObject*& entry, PyObject* const* args, Py_ssize_t n, Py_ssize_t want,
                    std::initializer_list<int> tensor_args, Call&& call) {
  HANDLE_TH_ERRORS
  bool plain = n == want && !at::impl::torch_function_mode_enabled();
  for (int i : tensor_args) plain = plain && (args[i] == Py_None || THPVariable_CheckExact(args[i]));
  if (plain) {
    try {
      at::Tensor out = call(Args{args});
      return THPVariable_Wrap(std::move(out));
    } catch (const NotPlain&) {
    }
  }
  if (entry == nullptr && (entry = boxed_entry(name)) == nullptr) return nullptr;
  return PyObject_Vectorcall(entry, args, n, nullptr);
  END_HANDLE_TH_ERRORS
}

template <class Sig>
c10::TypedOperatorHandle<Sig> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using OptTensor = std::optional<at::Tensor>;

PyObject* linear_norms(PyObject*, PyObject* const* args, Py_ssize_t n) {
  static PyObject* entry = nullptr;
  return fast_call("linear_norms", entry, args, n, 6, {0, 1, 2, 3}, [](const Args& a) {
    static const auto op = handle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                             const at::Tensor&, int64_t, std::optional<at::ScalarType>)>(
        "elasticlab::linear_norms");
    at::Tensor x = a.tensor(0), w = a.tensor(1), norms = a.tensor(3);
    OptTensor b = a.opt_tensor(2);
    const int64_t form = a.integer(4);
    const auto dtype = a.opt_dtype(5);
    NoGil no_gil;
    return op.call(x, w, b, norms, form, dtype);
  });
}

PyObject* conv_norms(PyObject*, PyObject* const* args, Py_ssize_t n) {
  static PyObject* entry = nullptr;
  return fast_call("conv_norms", entry, args, n, 12, {0, 1, 2, 7}, [](const Args& a) {
    static const auto op = handle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                             c10::IntArrayRef, c10::IntArrayRef, c10::IntArrayRef, int64_t,
                                             const at::Tensor&, int64_t, int64_t, std::optional<at::ScalarType>,
                                             bool)>("elasticlab::conv_norms");
    at::Tensor x = a.tensor(0), w = a.tensor(1), norms = a.tensor(7);
    OptTensor b = a.opt_tensor(2);
    const std::vector<int64_t> stride = a.ints(3), padding = a.ints(4), dilation = a.ints(5);
    const int64_t groups = a.integer(6), form = a.integer(8), chunk = a.integer(9);
    const auto dtype = a.opt_dtype(10);
    const bool tf32 = a.flag(11);
    NoGil no_gil;
    return op.call(x, w, b, stride, padding, dilation, groups, norms, form, chunk, dtype, tf32);
  });
}

PyObject* layer_norm_norms(PyObject*, PyObject* const* args, Py_ssize_t n) {
  static PyObject* entry = nullptr;
  return fast_call("layer_norm_norms", entry, args, n, 7, {0, 1, 2, 5}, [](const Args& a) {
    static const auto op = handle<at::Tensor(const at::Tensor&, const OptTensor&, const OptTensor&,
                                             c10::IntArrayRef, double, const at::Tensor&, bool)>(
        "elasticlab::layer_norm_norms");
    at::Tensor x = a.tensor(0), norms = a.tensor(5);
    OptTensor w = a.opt_tensor(1), b = a.opt_tensor(2);
    const std::vector<int64_t> shape = a.ints(3);
    const double eps = a.real(4);
    const bool upcast = a.flag(6);
    NoGil no_gil;
    return op.call(x, w, b, shape, eps, norms, upcast);
  });
}

PyObject* group_norm_norms(PyObject*, PyObject* const* args, Py_ssize_t n) {
  static PyObject* entry = nullptr;
  return fast_call("group_norm_norms", entry, args, n, 7, {0, 1, 2, 5}, [](const Args& a) {
    static const auto op = handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                             double, const at::Tensor&, bool)>("elasticlab::group_norm_norms");
    at::Tensor x = a.tensor(0), w = a.tensor(1), b = a.tensor(2), norms = a.tensor(5);
    const int64_t groups = a.integer(3);
    const double eps = a.real(4);
    const bool upcast = a.flag(6);
    NoGil no_gil;
    return op.call(x, w, b, groups, eps, norms, upcast);
  });
}

// tf32_mode (ops.h) of the calling thread set to the given int (-1, 0 or 1); returns the previous one. For the
// Python autograd functions of convolutions, whose kernels run on the thread that calls them.
PyObject* set_tf32_mode(PyObject*, PyObject* arg) {
  const long mode = PyLong_AsLong(arg);
  if (mode == -1 && PyErr_Occurred()) return nullptr;
  if (mode < -1 || mode > 1) {
    PyErr_Format(PyExc_ValueError, "set_tf32_mode: expected -1 (torch's matmul setting), 0 or 1, got %ld", mode);
    return nullptr;
  }
  const int prev = elasticlab::tf32_mode;
  elasticlab::tf32_mode = static_cast<int>(mode);
  return PyLong_FromLong(prev);
}

// scratch_bytes (ops.h), the CUDA forms' chunk budget, set to the given positive number of bytes; returns the
// previous budget.
PyObject* set_scratch_bytes(PyObject*, PyObject* arg) {
  const long long n = PyLong_AsLongLong(arg);
  if (n == -1 && PyErr_Occurred()) return nullptr;
  if (n < 1) {
    PyErr_Format(PyExc_ValueError, "set_scratch_bytes: expected a positive number of bytes, got %lld", n);
    return nullptr;
  }
  return PyLong_FromLongLong(elasticlab::scratch_bytes.exchange(n));
}

PyMethodDef methods[] = {
    {"linear_norms", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(linear_norms)), METH_FASTCALL,
     "torch.ops.elasticlab.linear_norms, called directly (same arguments, positional)"},
    {"conv_norms", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(conv_norms)), METH_FASTCALL,
     "torch.ops.elasticlab.conv_norms, called directly (same arguments, positional)"},
    {"layer_norm_norms", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(layer_norm_norms)),
     METH_FASTCALL, "torch.ops.elasticlab.layer_norm_norms, called directly (same arguments, positional)"},
    {"group_norm_norms", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(group_norm_norms)),
     METH_FASTCALL, "torch.ops.elasticlab.group_norm_norms, called directly (same arguments, positional)"},
    {"set_tf32_mode", set_tf32_mode, METH_O,
     "Sets TF32 for float32 per-example GEMMs on this thread (-1: torch's matmul setting, 0: off, 1: on); "
     "returns the previous mode"},
    {"set_scratch_bytes", set_scratch_bytes, METH_O,
     "Sets the CUDA forms' scratch budget per chunk of examples (bytes, positive); returns the previous one"},
    {nullptr, nullptr, 0, nullptr},
};

struct PyModuleDef elasticlab_module = {
    PyModuleDef_HEAD_INIT, "_C",
    "elasticlab compiled kernels, registered as torch.ops.elasticlab.*, and direct calls of the fused layers' "
    "operators",
    -1, methods,
};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&elasticlab_module); }

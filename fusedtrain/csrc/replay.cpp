// One C++ autograd node per op call, replaying that op's recorded work.
//
// An op (a Python autograd.Function of fusedtrain.ops) is recorded once per call signature
// by fusedtrain/ops/_replay.py: the allocations, views and kernel launches its forward
// made, and later those of its backward per gradient layout. From then on a call with that
// signature runs here: the signature read from the arguments, the record's tensors
// allocated, its kernels launched through the CUDA driver (or handed to a Python callable
// under triton's interpreter), and one torch::autograd::Function node built around the
// outputs, whose backward replays its own record without taking the GIL. A signature
// without a record runs the Python Function's code (with a stand-in ctx) through this node.

#include <Python.h>
#include <dlfcn.h>

#include <mutex>
#include <unordered_map>
#include <vector>

#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/core/GradMode.h>
#include <c10/util/hash.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// ---------------------------------------------------------------- the CUDA driver
using CUresult = int;
using LaunchKernel = CUresult (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  unsigned, unsigned, void*, void**, void**);
using CtxGetCurrent = CUresult (*)(void**);
using CtxSetCurrent = CUresult (*)(void*);
using DeviceGet = CUresult (*)(int*, int);
using PrimaryCtxRetain = CUresult (*)(void**, int);
using GetErrorString = CUresult (*)(CUresult, const char**);

struct Driver {
  LaunchKernel launch;
  CtxGetCurrent ctx_get;
  CtxSetCurrent ctx_set;
  DeviceGet device_get;
  PrimaryCtxRetain primary_ctx;
  GetErrorString error_string;
};

const Driver& driver() {
  static const Driver d = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(lib, "fusedtrain replay: cannot open libcuda.so.1");
    Driver d{(LaunchKernel)dlsym(lib, "cuLaunchKernel"),
             (CtxGetCurrent)dlsym(lib, "cuCtxGetCurrent"),
             (CtxSetCurrent)dlsym(lib, "cuCtxSetCurrent"),
             (DeviceGet)dlsym(lib, "cuDeviceGet"),
             (PrimaryCtxRetain)dlsym(lib, "cuDevicePrimaryCtxRetain"),
             (GetErrorString)dlsym(lib, "cuGetErrorString")};
    TORCH_CHECK(d.launch && d.ctx_get && d.ctx_set && d.device_get && d.primary_ctx &&
                    d.error_string,
                "fusedtrain replay: libcuda.so.1 lacks a driver entry point");
    return d;
  }();
  return d;
}

void check_cuda(CUresult code, const char* what) {
  if (code == 0) return;
  const char* text = nullptr;
  driver().error_string(code, &text);
  TORCH_CHECK(false, "fusedtrain replay: ", what, " failed: ", text ? text : "unknown error",
              " (CUresult ", code, ")");
}

// The thread's current context, as triton's launcher ensures it (a thread that has not
// touched CUDA through the runtime has none).
void ensure_context(int device) {
  const Driver& d = driver();
  void* ctx = nullptr;
  check_cuda(d.ctx_get(&ctx), "cuCtxGetCurrent");
  if (ctx) return;
  int handle = 0;
  check_cuda(d.device_get(&handle, device), "cuDeviceGet");
  check_cuda(d.primary_ctx(&ctx, handle), "cuDevicePrimaryCtxRetain");
  check_cuda(d.ctx_set(ctx), "cuCtxSetCurrent");
}

void* current_stream(int device) {
  c10::Device dev(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(dev).native_handle();
}

// ---------------------------------------------------------------- records
// A program's slots: its inputs first, then one per alloc or view step, in order.
enum ArgKind : int {
  PTR = 0, NULLPTR = 1, I32 = 2, I64 = 3, F32 = 4, F64 = 5, U32 = 6, U64 = 7, I8 = 8,
  I16 = 9, U8 = 10, U16 = 11,
};

struct Arg {
  int kind;
  int slot;        // PTR: the tensor whose address (plus delta) is passed
  int64_t value;   // integers, PTR's byte delta
  double real;     // floats
};

enum StepKind : int { ALLOC = 0, VIEW = 1, CUDA = 2, PYTHON = 3, ATEN = 4, CONST = 5 };

// An ATen op's argument, as a boxed call takes it: a tensor (slot), a list of them (slots;
// optional entries -1), or a constant IValue made once.
struct AtenArg {
  enum Kind : int { TENSOR = 0, TENSORS = 1, OPTIONAL_TENSORS = 2, CONSTANT = 3 } kind;
  int slot = -1;
  std::vector<int> slots;
  c10::IValue constant;
};

struct Step {
  int kind;
  // ALLOC / VIEW
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;  // VIEW: storage offset relative to the base slot's
  int base = -1;       // VIEW
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int device = -1;     // ALLOC: CUDA device index, -1 for the CPU
  // CUDA
  void* function = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 0, shared = 0;
  int64_t scratch = 0;  // bytes of global scratch memory per program (TMA descriptors)
  std::vector<Arg> args;
  // PYTHON: callable(list of the slots' tensors)
  PyObject* callable = nullptr;
  std::vector<int> slots;
  // ATEN: the op, its arguments in schema order, and per returned tensor whether it is a
  // new slot (else it is an argument returned again: an in-place or out= op)
  std::optional<c10::OperatorHandle> op;
  std::vector<AtenArg> aten_args;
  std::vector<bool> new_outputs;
  // CONST: a cached table the record holds (fusedtrain.kernels._launch.mark_constant)
  at::Tensor constant;
};

struct Program {
  std::vector<Step> steps;
  std::vector<int> outputs;  // slot per output, -1: None
};

int64_t as_int(PyObject* o) {
  int64_t v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw python_error();
  return v;
}

std::vector<int64_t> int_list(PyObject* seq) {
  std::vector<int64_t> out;
  Py_ssize_t n = PySequence_Size(seq);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_GetItem(seq, i);
    out.push_back(as_int(item));
    Py_DECREF(item);
  }
  return out;
}

std::vector<int> slot_list(PyObject* seq) {
  std::vector<int> out;
  for (int64_t v : int_list(seq)) out.push_back(static_cast<int>(v));
  return out;
}

PyObject* item(PyObject* seq, Py_ssize_t i) {  // borrowed, from a tuple
  TORCH_CHECK(PyTuple_Check(seq) && i < PyTuple_GET_SIZE(seq), "fusedtrain replay: bad record");
  return PyTuple_GET_ITEM(seq, i);
}

// An ATen argument as _replay.py encodes it: ("t", slot) | ("tl", slots) | ("otl", slots)
// | ("n",) | ("b", v) | ("i", v) | ("f", v) | ("wn", number: a wrapped-number tensor)
// | ("s", v) | ("il", ints) | ("fl", floats)
// | ("bl", bools) | ("dtype", code) | ("device", type, index) | ("layout", code)
// | ("mf", code).
AtenArg parse_aten_arg(PyObject* a) {
  std::string kind = PyUnicode_AsUTF8(item(a, 0));
  AtenArg out;
  out.kind = AtenArg::CONSTANT;
  if (kind == "t") {
    out.kind = AtenArg::TENSOR;
    out.slot = static_cast<int>(as_int(item(a, 1)));
  } else if (kind == "tl" || kind == "otl") {
    out.kind = kind == "tl" ? AtenArg::TENSORS : AtenArg::OPTIONAL_TENSORS;
    out.slots = slot_list(item(a, 1));
  } else if (kind == "n") {
    out.constant = c10::IValue();
  } else if (kind == "b") {
    out.constant = c10::IValue(item(a, 1) == Py_True);
  } else if (kind == "i") {
    out.constant = c10::IValue(as_int(item(a, 1)));
  } else if (kind == "f") {
    out.constant = c10::IValue(PyFloat_AsDouble(item(a, 1)));
  } else if (kind == "s") {
    out.constant = c10::IValue(std::string(PyUnicode_AsUTF8(item(a, 1))));
  } else if (kind == "il") {
    out.constant = c10::IValue(int_list(item(a, 1)));
  } else if (kind == "fl") {
    std::vector<double> v;
    PyObject* seq = item(a, 1);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(seq); ++i)
      v.push_back(PyFloat_AsDouble(PyTuple_GET_ITEM(seq, i)));
    out.constant = c10::IValue(v);
  } else if (kind == "bl") {
    c10::List<bool> v;
    PyObject* seq = item(a, 1);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(seq); ++i)
      v.push_back(PyTuple_GET_ITEM(seq, i) == Py_True);
    out.constant = c10::IValue(v);
  } else if (kind == "wn") {  // a Python number where the schema wants a tensor
    PyObject* v = item(a, 1);
    at::Tensor t = PyBool_Check(v) ? at::scalar_tensor(v == Py_True, at::kBool)
                   : PyLong_Check(v) ? at::scalar_tensor(as_int(v), at::kLong)
                                     : at::scalar_tensor(PyFloat_AsDouble(v), at::kDouble);
    t.unsafeGetTensorImpl()->set_wrapped_number(true);
    out.constant = c10::IValue(t);
  } else if (kind == "dtype") {
    out.constant = c10::IValue(static_cast<c10::ScalarType>(as_int(item(a, 1))));
  } else if (kind == "device") {
    int64_t index = as_int(item(a, 2));
    out.constant = c10::IValue(c10::Device(std::string(PyUnicode_AsUTF8(item(a, 1))) +
                                           (index >= 0 ? ":" + std::to_string(index) : "")));
  } else if (kind == "layout") {
    out.constant = c10::IValue(static_cast<c10::Layout>(as_int(item(a, 1))));
  } else if (kind == "mf") {
    out.constant = c10::IValue(static_cast<c10::MemoryFormat>(as_int(item(a, 1))));
  } else {
    TORCH_CHECK(false, "fusedtrain replay: unknown ATen argument ", kind);
  }
  return out;
}

// An ATen op called boxed, as the Python code called it; its new tensors become slots.
void call_aten(const Step& st, std::vector<at::Tensor>& slots) {
  torch::jit::Stack stack;
  stack.reserve(st.aten_args.size());
  for (const AtenArg& a : st.aten_args) {
    switch (a.kind) {
      case AtenArg::TENSOR:
        stack.emplace_back(slots[a.slot]);
        break;
      case AtenArg::TENSORS: {
        c10::List<at::Tensor> list;
        for (int s : a.slots) list.push_back(slots[s]);
        stack.emplace_back(list);
        break;
      }
      case AtenArg::OPTIONAL_TENSORS: {
        c10::List<std::optional<at::Tensor>> list;
        for (int s : a.slots)
          list.push_back(s < 0 ? std::optional<at::Tensor>() : std::optional<at::Tensor>(slots[s]));
        stack.emplace_back(list);
        break;
      }
      case AtenArg::CONSTANT:
        stack.push_back(a.constant);
        break;
    }
  }
  st.op->callBoxed(&stack);
  size_t k = 0;
  for (const c10::IValue& r : stack) {
    if (r.isTensor()) {
      if (st.new_outputs.at(k++)) slots.push_back(r.toTensor());
    } else if (r.isTensorList()) {
      for (const at::Tensor& t : r.toTensorVector())
        if (st.new_outputs.at(k++)) slots.push_back(t);
    }
  }
}

// A record as fusedtrain/ops/_replay.py writes it: (steps, outputs), each step a tuple
// ("alloc", sizes, strides, dtype, device) | ("view", base, sizes, strides, offset, dtype)
// | ("cuda", function, grid, block, shared, args, scratch) | ("python", callable, slots)
// | ("aten", name, overload, args, new outputs) | ("const", tensor); a kernel's arg (kind, slot, value, real).
Program parse_program(PyObject* record) {
  Program p;
  PyObject* steps = item(record, 0);
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(steps); ++i) {
    PyObject* s = item(steps, i);
    std::string kind = PyUnicode_AsUTF8(item(s, 0));
    Step st;
    if (kind == "alloc") {
      st.kind = ALLOC;
      st.sizes = int_list(item(s, 1));
      st.strides = int_list(item(s, 2));
      st.dtype = static_cast<c10::ScalarType>(as_int(item(s, 3)));
      st.device = static_cast<int>(as_int(item(s, 4)));
    } else if (kind == "view") {
      st.kind = VIEW;
      st.base = static_cast<int>(as_int(item(s, 1)));
      st.sizes = int_list(item(s, 2));
      st.strides = int_list(item(s, 3));
      st.offset = as_int(item(s, 4));
    } else if (kind == "cuda") {
      st.kind = CUDA;
      st.function = reinterpret_cast<void*>(as_int(item(s, 1)));
      std::vector<int64_t> grid = int_list(item(s, 2));
      for (int d = 0; d < 3; ++d) st.grid[d] = static_cast<unsigned>(grid[d]);
      st.block = static_cast<unsigned>(as_int(item(s, 3)));
      st.shared = static_cast<unsigned>(as_int(item(s, 4)));
      st.scratch = as_int(item(s, 6));
      PyObject* args = item(s, 5);
      for (Py_ssize_t a = 0; a < PyTuple_GET_SIZE(args); ++a) {
        PyObject* arg = item(args, a);
        st.args.push_back(Arg{static_cast<int>(as_int(item(arg, 0))),
                              static_cast<int>(as_int(item(arg, 1))), as_int(item(arg, 2)),
                              PyFloat_AsDouble(item(arg, 3))});
      }
    } else if (kind == "python") {
      st.kind = PYTHON;
      st.callable = item(s, 1);
      Py_INCREF(st.callable);
      for (int64_t slot : int_list(item(s, 2))) st.slots.push_back(static_cast<int>(slot));
    } else if (kind == "const") {
      st.kind = CONST;
      st.constant = THPVariable_Unpack(item(s, 1));
    } else if (kind == "aten") {
      st.kind = ATEN;
      st.op = c10::Dispatcher::singleton().findSchemaOrThrow(PyUnicode_AsUTF8(item(s, 1)),
                                                            PyUnicode_AsUTF8(item(s, 2)));
      PyObject* args = item(s, 3);
      for (Py_ssize_t a = 0; a < PyTuple_GET_SIZE(args); ++a)
        st.aten_args.push_back(parse_aten_arg(item(args, a)));
      for (int64_t flag : int_list(item(s, 4))) st.new_outputs.push_back(flag != 0);
    } else {
      TORCH_CHECK(false, "fusedtrain replay: unknown step ", kind);
    }
    p.steps.push_back(std::move(st));
  }
  for (int64_t slot : int_list(item(record, 1))) p.outputs.push_back(static_cast<int>(slot));
  return p;
}

// One launch's parameter block: every argument by address, as cuLaunchKernel takes them,
// then triton's two scratch pointers: global scratch allocated per launch as triton's
// launcher does (grid size x bytes per program), profile scratch null.
union Value {
  uint64_t u64;
  int64_t i64;
  int32_t i32;
  uint32_t u32;
  int16_t i16;
  uint16_t u16;
  int8_t i8;
  uint8_t u8;
  float f32;
  double f64;
};

void launch(const Step& st, const std::vector<at::Tensor>& slots, int device) {
  Value values[64];
  void* params[66];
  TORCH_CHECK(st.args.size() <= 64, "fusedtrain replay: too many kernel arguments");
  size_t n = 0;
  for (const Arg& a : st.args) {
    Value& v = values[n];
    switch (a.kind) {
      case PTR:
        v.u64 = reinterpret_cast<uint64_t>(slots[a.slot].data_ptr()) + a.value;
        break;
      case NULLPTR: v.u64 = 0; break;
      case I32: v.i32 = static_cast<int32_t>(a.value); break;
      case I64: v.i64 = a.value; break;
      case U32: v.u32 = static_cast<uint32_t>(a.value); break;
      case U64: v.u64 = static_cast<uint64_t>(a.value); break;
      case I8: v.i8 = static_cast<int8_t>(a.value); break;
      case I16: v.i16 = static_cast<int16_t>(a.value); break;
      case U8: v.u8 = static_cast<uint8_t>(a.value); break;
      case U16: v.u16 = static_cast<uint16_t>(a.value); break;
      case F32: v.f32 = static_cast<float>(a.real); break;
      case F64: v.f64 = a.real; break;
      default: TORCH_CHECK(false, "fusedtrain replay: bad argument kind");
    }
    params[n] = &values[n];
    ++n;
  }
  uint64_t global_scratch = 0, profile_scratch = 0;
  params[n++] = &global_scratch;
  params[n++] = &profile_scratch;
  const int64_t programs = int64_t(st.grid[0]) * st.grid[1] * st.grid[2];
  if (programs == 0) return;
  at::Tensor scratch;  // freed after the launch is queued: the allocator orders by stream
  if (st.scratch > 0) {
    scratch = at::empty({programs * st.scratch},
                        at::TensorOptions().dtype(at::kByte).device(
                            c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device))));
    global_scratch = reinterpret_cast<uint64_t>(scratch.data_ptr());
  }
  ensure_context(device);
  check_cuda(driver().launch(st.function, st.grid[0], st.grid[1], st.grid[2], st.block, 1, 1,
                             st.shared, current_stream(device), params, nullptr),
             "cuLaunchKernel");
}

// Runs a program over `slots` (its inputs already there); returns its outputs.
variable_list run(const Program& p, std::vector<at::Tensor>& slots, int device) {
  slots.reserve(slots.size() + p.steps.size());
  for (const Step& st : p.steps) {
    switch (st.kind) {
      case ALLOC: {
        auto options = at::TensorOptions().dtype(st.dtype).device(
            st.device < 0 ? c10::Device(c10::DeviceType::CPU)
                          : c10::Device(c10::DeviceType::CUDA,
                                        static_cast<c10::DeviceIndex>(st.device)));
        slots.push_back(at::empty_strided(st.sizes, st.strides, options));
        break;
      }
      case VIEW: {
        const at::Tensor& base = slots[st.base];
        slots.push_back(base.as_strided(st.sizes, st.strides, base.storage_offset() + st.offset));
        break;
      }
      case CUDA:
        launch(st, slots, device);
        break;
      case ATEN:
        call_aten(st, slots);
        break;
      case CONST:
        slots.push_back(st.constant);
        break;
      case PYTHON: {
        PyGILState_STATE gil = PyGILState_Ensure();
        PyObject* list = PyList_New(static_cast<Py_ssize_t>(st.slots.size()));
        for (size_t i = 0; i < st.slots.size(); ++i)
          PyList_SET_ITEM(list, i, THPVariable_Wrap(slots[st.slots[i]]));
        PyObject* result = PyObject_CallOneArg(st.callable, list);
        Py_DECREF(list);
        if (!result) {
          python_error err;
          err.persist();
          PyGILState_Release(gil);
          throw err;
        }
        Py_DECREF(result);
        PyGILState_Release(gil);
        break;
      }
    }
  }
  variable_list out;
  out.reserve(p.outputs.size());
  for (int slot : p.outputs) out.push_back(slot < 0 ? at::Tensor() : slots[slot]);
  return out;
}

// ---------------------------------------------------------------- signatures
struct Key {
  std::vector<int64_t> ints;
  std::vector<PyObject*> objects;  // arguments compared by value in Python (owned)
  size_t hash = 0;
  bool unkeyed = false;  // a Tensor subclass (or an unhashable value) among the arguments: never replayed
  bool operator==(const Key& o) const {
    if (hash != o.hash || ints != o.ints || objects.size() != o.objects.size()) return false;
    for (size_t i = 0; i < objects.size(); ++i) {
      int eq = PyObject_RichCompareBool(objects[i], o.objects[i], Py_EQ);
      if (eq != 1) {
        PyErr_Clear();
        return false;
      }
    }
    return true;
  }
};

struct KeyHash {
  size_t operator()(const Key& k) const { return k.hash; }
};

size_t mix(size_t h, uint64_t v) { return h ^ (v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2)); }

void add_tensor(std::vector<int64_t>& ints, const at::Tensor& t, bool grad) {
  ints.push_back(1);
  ints.push_back(static_cast<int64_t>(t.scalar_type()));
  ints.push_back(static_cast<int64_t>(t.device().type()));  // cpu, cuda, meta, ...
  ints.push_back(t.device().index());
  ints.push_back(t.dim());
  for (int64_t s : t.sizes()) ints.push_back(s);
  for (int64_t s : t.strides()) ints.push_back(s);
  ints.push_back(reinterpret_cast<uint64_t>(t.data_ptr()) & 15);
  if (grad) ints.push_back(t.requires_grad());
}

size_t hash_ints(const std::vector<int64_t>& ints) {
  size_t h = ints.size();
  for (int64_t v : ints) h = mix(h, static_cast<uint64_t>(v));
  return h;
}

// The forward's signature: each argument's layout (a tensor's dtype, device, sizes, strides,
// 16-byte alignment, requires_grad, and which earlier argument's memory it shares, at what
// distance) or value, with the modes an op may read: grad mode, autocast, deterministic.
Key forward_key(PyObject* args, std::vector<at::Tensor>& tensors) {
  Key k;
  auto& ints = k.ints;
  Py_ssize_t n = PyTuple_GET_SIZE(args);
  ints.reserve(8 + 24 * n);  // a tensor's entries: 9 + 2 x its dims
  tensors.reserve(n);
  ints.push_back(c10::GradMode::is_enabled());
  // An autocast dtype matters only while its autocast is on (`torch.autocast(enabled=False)`
  // still sets it): -1 otherwise.
  for (auto device : {at::kCUDA, at::kCPU}) {
    ints.push_back(at::autocast::is_autocast_enabled(device)
                       ? static_cast<int64_t>(at::autocast::get_autocast_dtype(device))
                       : -1);
  }
  ints.push_back(at::globalContext().deterministicAlgorithms());
  size_t hash = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = PyTuple_GET_ITEM(args, i);
    if (THPVariable_CheckExact(a)) {  // a Tensor or Parameter
      const at::Tensor& t = THPVariable_Unpack(a);
      add_tensor(ints, t, true);
      const void* data = t.has_storage() ? t.storage().data() : nullptr;
      int64_t shared_with = -1, distance = 0;
      for (size_t j = 0; j < tensors.size() && data; ++j) {
        const at::Tensor& o = tensors[j];
        if (o.defined() && o.has_storage() && o.storage().data() == data) {
          shared_with = static_cast<int64_t>(j);
          distance = t.storage_offset() * t.element_size() - o.storage_offset() * o.element_size();
          break;
        }
      }
      ints.push_back(shared_with);
      ints.push_back(distance);
      tensors.push_back(t);
    } else {
      tensors.push_back(at::Tensor());
      if (a == Py_None) {
        ints.push_back(2);
      } else if (PyBool_Check(a)) {
        ints.push_back(3);
        ints.push_back(a == Py_True);
      } else if (PyLong_CheckExact(a)) {
        int overflow = 0;
        int64_t v = PyLong_AsLongLongAndOverflow(a, &overflow);
        ints.push_back(overflow ? 5 : 4);
        if (overflow) {
          Py_INCREF(a);
          k.objects.push_back(a);
        } else {
          ints.push_back(v);
        }
      } else if (PyFloat_CheckExact(a)) {
        double v = PyFloat_AS_DOUBLE(a);
        int64_t bits;
        memcpy(&bits, &v, sizeof bits);
        ints.push_back(6);
        ints.push_back(bits);
      } else {
        // A Tensor subclass may give its ops other meanings: the Function's, each call.
        k.unkeyed = k.unkeyed || THPVariable_Check(a);
        Py_hash_t h = PyObject_Hash(a);
        if (h == -1) {  // unhashable (a caller's bad argument, before the op checks it)
          PyErr_Clear();
          k.unkeyed = true;
          h = 0;
        }
        ints.push_back(7);
        hash = mix(hash, static_cast<uint64_t>(h));
        Py_INCREF(a);
        k.objects.push_back(a);
      }
    }
  }
  k.hash = mix(hash_ints(ints), hash);
  return k;
}

void release(Key& k) {
  for (PyObject* o : k.objects) Py_DECREF(o);
  k.objects.clear();
}

// ---------------------------------------------------------------- ops
// A signature's or gradient layout's state: replayed from its record, run as Python code
// (the op's own Function: nothing here could record it), or not yet recorded (triton was
// still compiling or tuning a kernel of it; retried a few times).
enum State : int { RECORDED = 0, PYTHON_ONLY = 1, PENDING = 2 };
constexpr int ATTEMPTS = 3;

struct Backward {
  State state = PENDING;
  int attempts = 0;
  Program program;  // slots: the saved tensors, then the gradients, then its own
};

struct Op;

struct Forward {
  State state = PENDING;
  int attempts = 0;
  Op* op = nullptr;
  Program program;            // slots: the arguments (None for non-tensors), then its own
  std::vector<int> saved;     // slot per saved tensor, -1: None
  bool single = false;        // the forward returns one tensor, not a tuple
  size_t n_args = 0;
  std::vector<int> positions;  // the arguments that are tensors (the node's inputs)
  PyObject* attrs = nullptr;  // (ctx attributes, needs_input_grad): for the Python backward
  std::mutex mutex;           // guards backwards (looked up on autograd's threads)
  std::unordered_map<std::vector<int64_t>, Backward, c10::hash<std::vector<int64_t>>> backwards;
};

struct Op {
  PyObject* record_backward;  // (attrs, saved, grads, record) -> (grads, record | None, final)
  size_t limit;               // signatures kept; calls past it run the Python Function
  std::unordered_map<Key, Forward*, KeyHash> forwards;
};

std::vector<Op*> ops;

PyObject* wrap_or_none(const at::Tensor& t) {  // a new reference
  if (t.defined()) return THPVariable_Wrap(t);
  Py_INCREF(Py_None);
  return Py_None;
}

PyObject* tensor_list(const variable_list& ts) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(ts.size()));
  for (size_t i = 0; i < ts.size(); ++i) PyList_SET_ITEM(list, i, wrap_or_none(ts[i]));
  return list;
}

variable_list unpack_list(PyObject* seq) {
  variable_list out;
  PyObject* fast = PySequence_Fast(seq, "fusedtrain replay: expected a sequence of tensors");
  if (!fast) throw python_error();
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    PyObject* o = PySequence_Fast_GET_ITEM(fast, i);
    if (o == Py_None) {
      out.push_back(at::Tensor());
    } else {
      TORCH_CHECK(THPVariable_Check(o), "fusedtrain replay: expected a tensor or None");
      out.push_back(THPVariable_Unpack(o));
    }
  }
  Py_DECREF(fast);
  return out;
}

int device_of(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts)
    if (t.defined() && t.is_cuda()) return t.get_device();
  return -1;
}

std::vector<int64_t> gradient_key(const variable_list& grads) {
  std::vector<int64_t> key;
  key.reserve(16 * grads.size());
  for (const auto& g : grads) {
    if (g.defined()) add_tensor(key, g, false);
    else key.push_back(0);
  }
  return key;
}

// The Python backward (recorded when `record`), under the GIL.
variable_list python_backward(Forward& f, const variable_list& saved, const variable_list& grads,
                              Backward& b, bool record) {
  PyGILState_STATE gil = PyGILState_Ensure();
  variable_list out;
  try {
    PyObject* s = tensor_list(saved);
    PyObject* g = tensor_list(grads);
    PyObject* result = PyObject_CallFunctionObjArgs(f.op->record_backward, f.attrs, s, g,
                                                    record ? Py_True : Py_False, nullptr);
    Py_DECREF(s);
    Py_DECREF(g);
    if (!result) throw python_error();
    out = unpack_list(PyTuple_GET_ITEM(result, 0));
    if (record) {
      PyObject* rec = PyTuple_GET_ITEM(result, 1);
      std::lock_guard<std::mutex> lock(f.mutex);
      if (b.state != PENDING) {
        // another thread recorded this layout meanwhile; its program may be running
      } else if (rec != Py_None) {
        b.program = parse_program(rec);
        b.state = RECORDED;
      } else if (PyTuple_GET_ITEM(result, 2) == Py_True || ++b.attempts >= ATTEMPTS) {
        b.state = PYTHON_ONLY;
      }
    }
    Py_DECREF(result);
  } catch (python_error& e) {
    e.persist();
    PyGILState_Release(gil);
    throw;
  } catch (...) {
    PyGILState_Release(gil);
    throw;
  }
  PyGILState_Release(gil);
  return out;
}

struct ReplayFunction : public torch::autograd::Function<ReplayFunction> {
  static variable_list forward(AutogradContext* ctx, int64_t forward_address,
                               at::TensorList inputs) {
    Forward& f = *reinterpret_cast<Forward*>(forward_address);
    std::vector<at::Tensor> slots(f.n_args);
    for (size_t j = 0; j < f.positions.size(); ++j) slots[f.positions[j]] = inputs[j];
    variable_list outputs = run(f.program, slots, device_of(slots));
    variable_list saved;
    saved.reserve(f.saved.size());
    for (int s : f.saved) saved.push_back(s < 0 ? at::Tensor() : slots[s]);
    ctx->save_for_backward(saved);
    ctx->saved_data["forward"] = forward_address;
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Forward& f = *reinterpret_cast<Forward*>(ctx->saved_data["forward"].toInt());
    variable_list saved = ctx->get_saved_variables();
    std::vector<int64_t> key = gradient_key(grads);
    Backward* b;
    State state;
    {
      std::lock_guard<std::mutex> lock(f.mutex);
      b = &f.backwards[key];  // node-stable: unordered_map never moves its values
      state = b->state;
    }
    variable_list out;
    // create_graph=True: the Function's Python backward, which puts its gradients behind
    // an error node for a second differentiation (ops/_registry.py, _first_order_only);
    // never recorded.
    if (c10::GradMode::is_enabled()) {
      out = python_backward(f, saved, grads, *b, false);
    } else if (state == RECORDED) {
      std::vector<at::Tensor> slots;
      slots.reserve(saved.size() + grads.size() + b->program.steps.size());
      slots.insert(slots.end(), saved.begin(), saved.end());
      slots.insert(slots.end(), grads.begin(), grads.end());
      out = run(b->program, slots, device_of(slots));
    } else {
      out = python_backward(f, saved, grads, *b, state == PENDING);
    }
    variable_list grads_in{at::Tensor()};  // for the forward_address argument
    for (int pos : f.positions) grads_in.push_back(out.at(pos));
    return grads_in;
  }
};

PyObject* new_op(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* record_backward;
  Py_ssize_t limit;
  if (!PyArg_ParseTuple(args, "On", &record_backward, &limit)) return nullptr;
  Py_INCREF(record_backward);
  ops.push_back(new Op{record_backward, static_cast<size_t>(limit), {}});
  return PyLong_FromSsize_t(static_cast<Py_ssize_t>(ops.size() - 1));
  END_HANDLE_TH_ERRORS
}

PyObject* pack_outputs(const variable_list& outputs, bool single) {
  if (single) return THPVariable_Wrap(outputs.at(0));
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(outputs.size()));
  for (size_t i = 0; i < outputs.size(); ++i) PyTuple_SET_ITEM(tuple, i, wrap_or_none(outputs[i]));
  return tuple;
}

// apply(op, args) -> the op's outputs (a tensor or a tuple) replayed through one node;
// None: record this signature (run the Python Function under the recorder, then call
// store); NotImplemented: run the Python Function.
PyObject* apply(PyObject*, PyObject* py_args) {
  HANDLE_TH_ERRORS
  Py_ssize_t index;
  PyObject* args;
  if (!PyArg_ParseTuple(py_args, "nO!", &index, &PyTuple_Type, &args)) return nullptr;
  Op& op = *ops.at(index);
  variable_list inputs;
  Key key = forward_key(args, inputs);
  if (key.unkeyed) {
    release(key);
    Py_RETURN_NOTIMPLEMENTED;
  }
  auto it = op.forwards.find(key);
  release(key);
  if (it == op.forwards.end()) {
    if (op.forwards.size() >= op.limit) Py_RETURN_NOTIMPLEMENTED;
    Py_RETURN_NONE;
  }
  Forward& f = *it->second;
  if (f.state == PENDING) Py_RETURN_NONE;
  if (f.state == PYTHON_ONLY) Py_RETURN_NOTIMPLEMENTED;
  // The defined tensors, as a TensorList: Function::apply counts only those as inputs.
  variable_list defined;
  defined.reserve(f.positions.size());
  for (int pos : f.positions) defined.push_back(inputs[pos]);
  variable_list outputs =
      ReplayFunction::apply(reinterpret_cast<int64_t>(&f), at::TensorList(defined));
  return pack_outputs(outputs, f.single);
  END_HANDLE_TH_ERRORS
}

// store(op, args, record, final, attrs, single): what recording args' call gave. record:
// (program, saved slots) or None (then final: never replayable, else retried).
PyObject* store(PyObject*, PyObject* py_args) {
  HANDLE_TH_ERRORS
  Py_ssize_t index;
  PyObject *args, *record, *final, *attrs, *single;
  if (!PyArg_ParseTuple(py_args, "nO!OOOO", &index, &PyTuple_Type, &args, &record, &final,
                        &attrs, &single))
    return nullptr;
  Op& op = *ops.at(index);
  variable_list inputs;
  Key key = forward_key(args, inputs);
  auto it = op.forwards.find(key);
  Forward* f;
  if (it != op.forwards.end()) {
    release(key);
    f = it->second;
  } else {
    if (op.forwards.size() >= op.limit) {
      release(key);
      Py_RETURN_NONE;
    }
    f = new Forward();
    f->op = &op;
    op.forwards.emplace(std::move(key), f);
  }
  if (f->state != PENDING) Py_RETURN_NONE;
  if (record != Py_None) {
    f->program = parse_program(PyTuple_GET_ITEM(record, 0));
    f->saved.clear();
    for (int64_t s : int_list(PyTuple_GET_ITEM(record, 1))) f->saved.push_back(static_cast<int>(s));
    f->single = single == Py_True;
    f->n_args = inputs.size();
    f->positions.clear();
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].defined()) f->positions.push_back(static_cast<int>(i));
    Py_INCREF(attrs);
    f->attrs = attrs;
    f->state = RECORDED;
  } else if (final == Py_True || ++f->attempts >= ATTEMPTS) {
    f->state = PYTHON_ONLY;
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// Whether this module reads the current stream as torch does (checked once on a GPU).
PyObject* stream_handle(PyObject*, PyObject* arg) {
  HANDLE_TH_ERRORS
  return PyLong_FromVoidPtr(current_stream(static_cast<int>(as_int(arg))));
  END_HANDLE_TH_ERRORS
}

PyObject* signatures(PyObject*, PyObject* arg) {
  HANDLE_TH_ERRORS
  Op& op = *ops.at(as_int(arg));
  size_t recorded = 0;
  for (auto& kv : op.forwards) recorded += kv.second->state == RECORDED;
  return Py_BuildValue("(nn)", static_cast<Py_ssize_t>(op.forwards.size()),
                       static_cast<Py_ssize_t>(recorded));
  END_HANDLE_TH_ERRORS
}

// Forget every record of an op (its Function's code changed); nodes alive keep theirs.
PyObject* reset(PyObject*, PyObject* arg) {
  HANDLE_TH_ERRORS
  ops.at(as_int(arg))->forwards.clear();
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"reset", reset, METH_O, "reset(op): forget the op's records"},
    {"new_op", new_op, METH_VARARGS, "new_op(record_backward, limit) -> op"},
    {"apply", apply, METH_VARARGS, "apply(op, args) -> outputs | None | NotImplemented"},
    {"store", store, METH_VARARGS, "store(op, args, record, final, attrs, single)"},
    {"stream_handle", stream_handle, METH_O, "stream_handle(device) -> torch's current stream"},
    {"signatures", signatures, METH_O, "signatures(op) -> (signatures seen, recorded)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "fusedtrain_replay", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_fusedtrain_replay() { return PyModule_Create(&module); }

// qtorch-onnx ONNX Runtime operator library: the custom operators and their registration.
//
// Domain com.amd.quark, version 1 (docs/operators.md): BFPQuantizeDequantize, MXQuantizeDequantize,
// ExtendedQuantizeLinear, ExtendedDequantizeLinear, with Quark 0.13's names, attributes and defaults.
// Legacy alias domain com.vai.quantize: BFPFixNeuron, MXFixNeuron, VitisQuantizeLinear,
// VitisDequantizeLinear (the same kernels).
//
// Built against ONNX Runtime's C/C++ API headers (1.17, ORT_API_VERSION 17) without linking to
// onnxruntime: RegisterCustomOps receives the runtime's OrtApiBase and asks it for GetApi(ORT_API_VERSION),
// so the library loads into ONNX Runtime 1.17 and every newer release. No torch, no Python.
//
// Errors never abort the process: invalid attributes fail kernel creation (session creation) with an
// ONNX Runtime status naming the operator, the node and the attribute and what would be valid; invalid
// inputs fail Run() the same way. The input buffers are only read; every output element is written.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#ifdef QTORCH_ORT_FLAT_HEADERS
#include "onnxruntime_cxx_api.h"
#else
#include "onnxruntime/core/session/onnxruntime_cxx_api.h"
#endif

#include "block_kernels.h"
#include "kernels.h"
#include "numerics.h"

#if defined(_WIN32)
#define QTORCH_ORT_EXPORT __declspec(dllexport)
#else
#define QTORCH_ORT_EXPORT __attribute__((visibility("default")))
#endif

namespace qtorch_ort {
namespace {

constexpr ONNXTensorElementDataType kFloat = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr ONNXTensorElementDataType kHalf = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr ONNXTensorElementDataType kBFloat16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
constexpr ONNXTensorElementDataType kUndefined = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;

// An invalid attribute or input; the message is complete (operator, node, attribute/input, valid values).
class KernelError : public std::runtime_error {
 public:
  explicit KernelError(const std::string& msg) : std::runtime_error(msg) {}
};

const char* TypeName(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return "float64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return "int8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return "uint8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16: return "int16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16: return "uint16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return "int32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32: return "uint32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return "int64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64: return "uint64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return "bool";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_STRING: return "string";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED: return "undefined";
    default: return "another type";
  }
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

// The zero-point element types of ExtendedQuantizeLinear / ExtendedDequantizeLinear (docs/operators.md).
bool IsQdqType(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return true;
    default: return false;
  }
}
const char* kQdqTypes = "int8, uint8, int16, uint16, int32, uint32, bfloat16, float16";

enum class OpKind { kBfp, kMx, kQuantize, kDequantize };

// ---------------------------------------------------------------------------------------------------
// Kernel-creation helpers on the raw C API (the 1.17 C++ wrappers throw on a missing attribute and cannot
// tell a missing attribute from one of the wrong type).
// ---------------------------------------------------------------------------------------------------
class InfoReader {
 public:
  InfoReader(const OrtApi& api, const OrtKernelInfo* info, const char* domain, const char* op)
      : api_(api), info_(info) {
    const std::string node = NodeName();
    std::ostringstream os;
    os << domain << "::" << op << " node '" << node << "'";
    if (node.empty()) os << " (output '" << OutputName(0) << "')";
    label_ = os.str();
  }

  const std::string& label() const { return label_; }

  [[noreturn]] void Fail(const std::string& what) const { throw KernelError(label_ + ": " + what); }

  // INT attribute, or dflt when absent. An attribute of another type is an error.
  int64_t Int(const char* name, int64_t dflt) const {
    int64_t v = 0;
    if (OrtStatus* st = api_.KernelInfoGetAttribute_int64(info_, name, &v)) {
      api_.ReleaseStatus(st);
      if (Present(name)) Fail(std::string("attribute '") + name + "' has the wrong type; valid: an INT attribute");
      return dflt;
    }
    return v;
  }

  // STRING attribute, or dflt when absent. An attribute of another type is an error.
  std::string String(const char* name, const std::string& dflt) const {
    size_t size = 0;
    if (OrtStatus* st = api_.KernelInfoGetAttribute_string(info_, name, nullptr, &size)) {
      api_.ReleaseStatus(st);
      if (Present(name)) Fail(std::string("attribute '") + name + "' has the wrong type; valid: a STRING attribute");
      return dflt;
    }
    std::string s(size + 1, '\0');
    size_t cap = s.size();
    if (OrtStatus* st = api_.KernelInfoGetAttribute_string(info_, name, &s[0], &cap)) {
      api_.ReleaseStatus(st);
      Fail(std::string("attribute '") + name + "' could not be read");
    }
    s.resize(std::strlen(s.c_str()));
    return s;
  }

  // Element type and rank of input `index` as declared in the graph. rank is -1 when unknown; ONNX Runtime
  // reports an unknown shape with zero dimensions, so a declared rank of 0 is reported as unknown too.
  void InputType(size_t index, ONNXTensorElementDataType* type, int64_t* rank) const {
    *type = kUndefined;
    *rank = -1;
    OrtTypeInfo* ti = nullptr;
    if (OrtStatus* st = api_.KernelInfo_GetInputTypeInfo(info_, index, &ti)) {
      api_.ReleaseStatus(st);
      return;
    }
    const OrtTensorTypeAndShapeInfo* tsi = nullptr;
    if (OrtStatus* st = api_.CastTypeInfoToTensorInfo(ti, &tsi)) {
      api_.ReleaseStatus(st);
    } else if (tsi != nullptr) {
      ONNXTensorElementDataType t = kUndefined;
      if (OrtStatus* s2 = api_.GetTensorElementType(tsi, &t)) api_.ReleaseStatus(s2);
      else *type = t;
      size_t n = 0;
      if (OrtStatus* s3 = api_.GetDimensionsCount(tsi, &n)) api_.ReleaseStatus(s3);
      else if (n > 0) *rank = static_cast<int64_t>(n);
    }
    api_.ReleaseTypeInfo(ti);
  }

  std::string InputName(size_t index) const {
    size_t size = 0;
    if (OrtStatus* st = api_.KernelInfo_GetInputName(info_, index, nullptr, &size)) {
      api_.ReleaseStatus(st);
      return std::string();
    }
    std::string s(size + 1, '\0');
    size_t cap = s.size();
    if (OrtStatus* st = api_.KernelInfo_GetInputName(info_, index, &s[0], &cap)) {
      api_.ReleaseStatus(st);
      return std::string();
    }
    s.resize(std::strlen(s.c_str()));
    return s;
  }

 private:
  std::string NodeName() const {
    size_t size = 0;
    if (OrtStatus* st = api_.KernelInfo_GetNodeName(info_, nullptr, &size)) {
      api_.ReleaseStatus(st);
      return std::string();
    }
    std::string s(size + 1, '\0');
    size_t cap = s.size();
    if (OrtStatus* st = api_.KernelInfo_GetNodeName(info_, &s[0], &cap)) {
      api_.ReleaseStatus(st);
      return std::string();
    }
    s.resize(std::strlen(s.c_str()));
    return s;
  }

  std::string OutputName(size_t index) const {
    size_t size = 0;
    if (OrtStatus* st = api_.KernelInfo_GetOutputName(info_, index, nullptr, &size)) {
      api_.ReleaseStatus(st);
      return std::string();
    }
    std::string s(size + 1, '\0');
    size_t cap = s.size();
    if (OrtStatus* st = api_.KernelInfo_GetOutputName(info_, index, &s[0], &cap)) {
      api_.ReleaseStatus(st);
      return std::string();
    }
    s.resize(std::strlen(s.c_str()));
    return s;
  }

  // True if an attribute `name` exists with any of the types INT, FLOAT, STRING, INTS, FLOATS.
  bool Present(const char* name) const {
    auto ok = [this](OrtStatus* st) {
      if (st == nullptr) return true;
      api_.ReleaseStatus(st);
      return false;
    };
    int64_t i = 0;
    float f = 0.0f;
    size_t size = 0;
    if (ok(api_.KernelInfoGetAttribute_int64(info_, name, &i))) return true;
    if (ok(api_.KernelInfoGetAttribute_float(info_, name, &f))) return true;
    if (ok(api_.KernelInfoGetAttribute_string(info_, name, nullptr, &size))) return true;
    size = 0;
    if (ok(api_.KernelInfoGetAttributeArray_int64(info_, name, nullptr, &size))) return true;
    size = 0;
    if (ok(api_.KernelInfoGetAttributeArray_float(info_, name, nullptr, &size))) return true;
    return false;
  }

  const OrtApi& api_;
  const OrtKernelInfo* info_;
  std::string label_;
};

// TaskRunner on the session's intra-op thread pool (KernelContext_ParallelFor, ORT API 17). With
// intra_op_num_threads = 1 ONNX Runtime runs the tasks on the calling thread.
class OrtRunner final : public TaskRunner {
 public:
  OrtRunner(const OrtApi& api, const OrtKernelContext* ctx) : api_(api), ctx_(ctx) {}
  void Run(size_t n_tasks, TaskFn fn, void* data) const override {
    if (OrtStatus* st = api_.KernelContext_ParallelFor(ctx_, fn, n_tasks, 0, data)) {
      api_.ReleaseStatus(st);
      SerialRunner().Run(n_tasks, fn, data);  // every task is idempotent: recomputing is safe
    }
  }

 private:
  const OrtApi& api_;
  const OrtKernelContext* ctx_;
};

std::string AttrValue(int64_t v) { return std::to_string(v); }
std::string AttrValue(const std::string& v) { return "'" + v + "'"; }

// Normalizes the block axis of a rank-`rank` tensor (docs/numerics.md section 4: rank <= 1 ignores it).
int64_t NormalizeBlockAxis(const InfoReader* reader, const std::string& label, int64_t axis, int64_t rank,
                           const char* what) {
  if (rank <= 1) return 0;
  if (axis < -rank || axis >= rank) {
    std::ostringstream os;
    os << label << ": attribute 'axis'=" << axis << " is out of range for the rank-" << rank << " " << what
       << "; valid: integers in [" << -rank << ", " << rank - 1 << "]";
    (void)reader;
    throw KernelError(os.str());
  }
  return axis < 0 ? axis + rank : axis;
}

// ---------------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------------
class KernelBase {
 public:
  KernelBase(const OrtApi& api, std::string label) : api_(api), label_(std::move(label)) {}
  virtual ~KernelBase() = default;

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    try {
      Compute(context);
      return nullptr;
    } catch (const KernelError& e) {
      return api_.CreateStatus(ORT_INVALID_ARGUMENT, e.what());
    } catch (const Ort::Exception& e) {
      return api_.CreateStatus(e.GetOrtErrorCode(), (label_ + ": " + e.what()).c_str());
    } catch (const std::exception& e) {
      return api_.CreateStatus(ORT_FAIL, (label_ + ": " + e.what()).c_str());
    } catch (...) {
      return api_.CreateStatus(ORT_FAIL, (label_ + ": unknown error").c_str());
    }
  }

 protected:
  virtual void Compute(OrtKernelContext* context) = 0;
  [[noreturn]] void Fail(const std::string& what) const { throw KernelError(label_ + ": " + what); }

  const OrtApi& api_;
  std::string label_;
};

// Shared part of BFPQuantizeDequantize and MXQuantizeDequantize: input checks, layout, one-element rule,
// float32 / float16 dispatch.
class BlockKernel : public KernelBase {
 public:
  BlockKernel(const OrtApi& api, const InfoReader& r, int64_t axis, int64_t block_size)
      : KernelBase(api, r.label()), axis_(axis), block_size_(block_size), input_name_(r.InputName(0)) {
    ONNXTensorElementDataType t;
    int64_t rank;
    r.InputType(0, &t, &rank);
    if (t != kUndefined && t != kFloat && t != kHalf)
      r.Fail(std::string("input '") + input_name_ + "' has element type " + TypeName(t) + "; valid: float32, float16");
    if (rank >= 2) NormalizeBlockAxis(&r, label_, axis_, rank, ("input '" + input_name_ + "'").c_str());
  }

 protected:
  // Quantize-dequantize a whole tensor laid out as `lay`.
  virtual void RunTensor(const float* x, float* y, const BlockLayout& lay, const TaskRunner& runner) = 0;
  virtual void RunTensor(const uint16_t* x, uint16_t* y, const BlockLayout& lay, const TaskRunner& runner) = 0;
  // The value of a one-element tensor (returned unchanged except for BFP's bfloat16 pre-rounding).
  virtual float OneElement(float x) const { return x; }

  void Compute(OrtKernelContext* context) override {
    Ort::KernelContext ctx(context);
    Ort::ConstValue in = ctx.GetInput(0);
    const auto info = in.GetTensorTypeAndShapeInfo();
    const ONNXTensorElementDataType type = info.GetElementType();
    const std::vector<int64_t> shape = info.GetShape();
    if (type != kFloat && type != kHalf)
      Fail(std::string("input '") + input_name_ + "' has element type " + TypeName(type) + "; valid: float32, float16");
    const int64_t rank = static_cast<int64_t>(shape.size());
    const int64_t ax = NormalizeBlockAxis(nullptr, label_, axis_, rank, ("input '" + input_name_ + "'").c_str());
    Ort::UnownedValue out = ctx.GetOutput(0, shape.data(), shape.size());
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    if (numel == 0) return;
    if (numel == 1) {  // docs/numerics.md section 4: a one-element tensor is returned unchanged
      if (type == kFloat) {
        out.GetTensorMutableData<float>()[0] = OneElement(in.GetTensorData<float>()[0]);
      } else {
        const uint16_t h = reinterpret_cast<const uint16_t*>(in.GetTensorRawData())[0];
        const float v = OneElement(half_to_float(h));
        uint16_t* yh = static_cast<uint16_t*>(out.GetTensorMutableRawData());
        yh[0] = (bits_of(v) == bits_of(half_to_float(h))) ? h : float_to_half(v);
      }
      return;
    }
    BlockLayout lay;
    lay.block_size = block_size_;
    if (rank <= 1) {
      lay.length = numel;
    } else {
      for (int64_t d = 0; d < ax; ++d) lay.outer *= shape[d];
      lay.length = shape[ax];
      for (int64_t d = ax + 1; d < rank; ++d) lay.inner *= shape[d];
    }
    OrtRunner runner(api_, context);
    if (type == kFloat) {
      RunTensor(in.GetTensorData<float>(), out.GetTensorMutableData<float>(), lay, runner);
    } else {
      RunTensor(reinterpret_cast<const uint16_t*>(in.GetTensorRawData()),
                static_cast<uint16_t*>(out.GetTensorMutableRawData()), lay, runner);
    }
  }

  template <typename T, typename Fn>
  void Dispatch(const T* x, T* y, const BlockLayout& lay, const Fn& fn, const TaskRunner& runner) {
    if (!RunBlocks(x, y, lay, fn, runner)) Fail("out of memory while quantizing input '" + input_name_ + "'");
  }

  int64_t axis_;
  int64_t block_size_;
  std::string input_name_;
};

// BFPQuantizeDequantize / BFPFixNeuron (docs/numerics.md sections 4-6; formats/bfp.py).
class BfpKernel final : public BlockKernel {
 public:
  static BfpKernel* Create(const OrtApi& api, const InfoReader& r) {
    const std::string method = r.String("bfp_method", "to_bfp");
    const int64_t axis = r.Int("axis", 1);
    const int64_t bit_width = r.Int("bit_width", 16);
    const int64_t block_size = r.Int("block_size", 8);
    const int64_t rounding_mode = r.Int("rounding_mode", 0);
    const int64_t sub_block_size = r.Int("sub_block_size", 2);
    const int64_t shift_bits = r.Int("sub_block_shift_bits", 1);
    const int64_t to_bf16 = r.Int("convert_to_bfloat_before_bfp", 0);
    // Same rules, in the same order, as qtorch_onnx.formats.bfp.validate_bfp_attributes.
    bool prime;
    if (method == "to_bfp") prime = false;
    else if (method == "to_bfp_prime" || method == "to_bfp_prime_shared") prime = true;
    else r.Fail("attribute 'bfp_method'=" + AttrValue(method) + " is unknown; valid: to_bfp, to_bfp_prime, to_bfp_prime_shared");
    if (bit_width < 10 || bit_width > 32)
      r.Fail("attribute 'bit_width'=" + AttrValue(bit_width) + " is out of range; valid: integers [10, 32] "
             "(8-bit shared exponent + sign + 1..23 magnitude bits)");
    if (block_size < 1) r.Fail("attribute 'block_size'=" + AttrValue(block_size) + " is out of range; valid: integers >= 1");
    if (rounding_mode < 0 || rounding_mode > 2)
      r.Fail("attribute 'rounding_mode'=" + AttrValue(rounding_mode) + " is invalid; valid: 0 (half away from zero), "
             "1 (half toward +infinity), 2 (half to even)");
    if (sub_block_size < 1)
      r.Fail("attribute 'sub_block_size'=" + AttrValue(sub_block_size) + " is out of range; valid: integers >= 1");
    if (shift_bits < 1 || shift_bits > 8)
      r.Fail("attribute 'sub_block_shift_bits'=" + AttrValue(shift_bits) + " is out of range; valid: integers [1, 8]");
    if (to_bf16 != 0 && to_bf16 != 1)
      r.Fail("attribute 'convert_to_bfloat_before_bfp'=" + AttrValue(to_bf16) + " is invalid; valid: 0, 1");
    if (prime && block_size % sub_block_size != 0) {
      std::ostringstream os;
      os << "attribute 'block_size'=" << block_size << " is not a multiple of 'sub_block_size'=" << sub_block_size
         << " (required by bfp_method '" << method << "'); valid: block sizes " << sub_block_size << ", "
         << 2 * sub_block_size << ", " << 3 * sub_block_size << ", ...";
      r.Fail(os.str());
    }
    return new BfpKernel(api, r, axis, block_size, prime, static_cast<int>(bit_width - 9),
                         static_cast<int>(rounding_mode), sub_block_size, static_cast<int>(shift_bits), to_bf16 == 1);
  }

 private:
  BfpKernel(const OrtApi& api, const InfoReader& r, int64_t axis, int64_t block_size, bool prime, int m, int mode,
            int64_t sub_block_size, int shift_bits, bool to_bf16)
      : BlockKernel(api, r, axis, block_size), to_bf16_(to_bf16) {
    params_.prime = prime;
    params_.m = m;
    params_.mode = mode;
    params_.sub_block_size = sub_block_size;
    params_.shift_bits = shift_bits;
    params_.pre_bf16 = to_bf16;
  }

  float OneElement(float x) const override { return to_bf16_ ? bfloat16_round_quark(x) : x; }

  template <typename T>
  void Run(const T* x, T* y, const BlockLayout& lay, const TaskRunner& runner) {
    const BfpParams p = params_;
    Dispatch(x, y, lay, [p](const float* in, float* out, int64_t n, int64_t count) {
      bfp_blocks(in, out, n, count, p);
    }, runner);
  }
  void RunTensor(const float* x, float* y, const BlockLayout& lay, const TaskRunner& runner) override {
    Run(x, y, lay, runner);
  }
  void RunTensor(const uint16_t* x, uint16_t* y, const BlockLayout& lay, const TaskRunner& runner) override {
    Run(x, y, lay, runner);
  }

  BfpParams params_;
  bool to_bf16_;
};

// MXQuantizeDequantize / MXFixNeuron (docs/numerics.md sections 4 and 7; formats/mx.py).
class MxKernel final : public BlockKernel {
 public:
  static MxKernel* Create(const OrtApi& api, const InfoReader& r) {
    const std::string dtype = r.String("element_dtype", "int8");
    const int64_t axis = r.Int("axis", 1);
    const int64_t block_size = r.Int("block_size", 32);
    const int64_t rounding_mode = r.Int("rounding_mode", 0);
    // Same rules as qtorch_onnx.formats.mx.validate_mx_attributes; rounding_mode: any integer (only int8
    // elements use it; values other than 0/1/2 behave as 0).
    MXElement el;
    if (dtype == "int8") el = MXElement{0, 6, 0, 0, 127.0f / 64.0f};
    else if (dtype == "fp8_e4m3") el = MXElement{4, 3, 7, 8, 448.0f};
    else if (dtype == "fp8_e5m2") el = MXElement{5, 2, 15, 15, 57344.0f};
    else if (dtype == "fp6_e3m2") el = MXElement{3, 2, 3, 4, 28.0f};
    else if (dtype == "fp6_e2m3") el = MXElement{2, 3, 1, 2, 7.5f};
    else if (dtype == "fp4_e2m1") el = MXElement{2, 1, 1, 2, 6.0f};
    else r.Fail("attribute 'element_dtype'=" + AttrValue(dtype) + " is unknown; valid: int8, fp8_e4m3, fp8_e5m2, "
                "fp6_e3m2, fp6_e2m3, fp4_e2m1");
    if (block_size < 1) r.Fail("attribute 'block_size'=" + AttrValue(block_size) + " is invalid; valid: integers >= 1");
    const int mode = (rounding_mode >= 0 && rounding_mode <= 2) ? static_cast<int>(rounding_mode) : 0;
    return new MxKernel(api, r, axis, block_size, el, mode);
  }

 private:
  MxKernel(const OrtApi& api, const InfoReader& r, int64_t axis, int64_t block_size, const MXElement& el, int mode)
      : BlockKernel(api, r, axis, block_size), el_(el), mode_(mode) {}

  template <typename T>
  void Run(const T* x, T* y, const BlockLayout& lay, const TaskRunner& runner) {
    const MXElement el = el_;
    const int mode = mode_;
    Dispatch(x, y, lay, [el, mode](const float* in, float* out, int64_t n, int64_t count) {
      mx_blocks(in, out, n, count, el, mode);
    }, runner);
  }
  void RunTensor(const float* x, float* y, const BlockLayout& lay, const TaskRunner& runner) override {
    Run(x, y, lay, runner);
  }
  void RunTensor(const uint16_t* x, uint16_t* y, const BlockLayout& lay, const TaskRunner& runner) override {
    Run(x, y, lay, runner);
  }

  MXElement el_;
  int mode_;
};

// ---------------------------------------------------------------------------------------------------
// ExtendedQuantizeLinear / ExtendedDequantizeLinear (docs/numerics.md sections 1 and 3; formats/integer.py,
// formats/floating.py).
// ---------------------------------------------------------------------------------------------------
// Integer quantize: q = saturate(round_half_even(x / scale) + zero_point), x / scale a float32 division.
// NaN / Inf rule (the project's contract, that of ONNX Runtime's QuantizeLinear, README "Operator
// library"): NaN -> the type minimum whatever the zero point; +Inf -> the type maximum and -Inf -> the
// type minimum (saturation); |x / scale| beyond the type's range saturates. Quark's own kernel converts
// NaN/Inf/huge quotients to int64 out of range (undefined behaviour); we do not copy that.
// The sum is formed in float32 for 8/16-bit types (exact below 2^24; anything larger saturates whatever
// the rounding, as in formats/integer.py) and in float64 for 32-bit types (exact below 2^53).
template <typename Q, typename Acc>
struct IntQuantize {
  const float* scale;
  const Acc* zero_point;
  struct Op {
    float s;
    Acc zp;
    Q operator()(float x) const {
      const float v = x / s;
      Acc t = static_cast<Acc>(round_half_even(v)) + zp;
      const Acc lo = static_cast<Acc>(std::numeric_limits<Q>::min());
      const Acc hi = static_cast<Acc>(std::numeric_limits<Q>::max());
      t = t >= lo ? t : lo;  // NaN fails the comparison: type minimum
      t = t <= hi ? t : hi;
      // t is integral and inside Q's range: the conversion is exact (int32 for the float accumulator)
      using Int = typename std::conditional<std::is_same<Acc, float>::value, int32_t, int64_t>::type;
      return static_cast<Q>(static_cast<Int>(t));
    }
  };
  Op at(int64_t c) const { return Op{scale[c], zero_point[c]}; }
};

// Integer dequantize: y = float32(q - zero_point) * scale (the difference exact in Acc: int32 for 8/16-bit
// types, int64 for 32-bit ones, rounded to float32 once, then a float32 product).
template <typename Q, typename Acc>
struct IntDequantize {
  const float* scale;
  const Acc* zero_point;
  struct Op {
    float s;
    Acc zp;
    float operator()(Q q) const { return static_cast<float>(static_cast<Acc>(q) - zp) * s; }
  };
  Op at(int64_t c) const { return Op{scale[c], zero_point[c]}; }
};

// bfloat16 quantize (Quark): bf16(x / scale + zero_point) in float32, round to nearest even; NaN -> 0x7FC1.
struct Bf16Quantize {
  const float* scale;
  const float* zero_point;
  struct Op {
    float s, zp;
    uint16_t operator()(float x) const { return bfloat16_bits_rne(x / s + zp, 0x7FC1u); }
  };
  Op at(int64_t c) const { return Op{scale[c], zero_point[c]}; }
};

// bfloat16 dequantize (Quark): (float(q) - float(zero_point)) * scale; every NaN -> 0x7FC00000.
struct Bf16Dequantize {
  const float* scale;
  const float* zero_point;
  struct Op {
    float s, zp;
    float operator()(uint16_t q) const {
      const float y = (bfloat16_to_float(q) - zp) * s;
      return (y != y) ? float_of(0x7FC00000u) : y;
    }
  };
  Op at(int64_t c) const { return Op{scale[c], zero_point[c]}; }
};

// float16 quantize (Quark): float16(clip(x, -65504, 65504)); scale and zero point are ignored. NaN stays NaN.
struct Fp16Quantize {
  struct Op {
    uint16_t operator()(float x) const {
      const float c = x > 65504.0f ? 65504.0f : (x < -65504.0f ? -65504.0f : x);  // NaN passes through
      return float_to_half(c);
    }
  };
  Op at(int64_t) const { return Op{}; }
};

// float16 dequantize (Quark): exact widening; scale and zero point are ignored.
struct Fp16Dequantize {
  struct Op {
    float operator()(uint16_t q) const { return half_to_float(q); }
  };
  Op at(int64_t) const { return Op{}; }
};

class QdqKernel final : public KernelBase {
 public:
  static QdqKernel* Create(const OrtApi& api, const InfoReader& r, bool quantize) {
    const int64_t axis = r.Int("axis", 0);
    ONNXTensorElementDataType zt, xt;
    int64_t zrank, xrank;
    r.InputType(2, &zt, &zrank);
    r.InputType(0, &xt, &xrank);
    if (zt != kUndefined && !IsQdqType(zt))
      r.Fail(std::string("input 'zero_point' ('") + r.InputName(2) + "') has element type " + TypeName(zt) +
             "; valid: " + kQdqTypes + " (the zero point's type selects the quantized type)");
    if (!quantize && xt != kUndefined && zt != kUndefined && xt != zt)
      r.Fail(std::string("input 'x' ('") + r.InputName(0) + "') has element type " + TypeName(xt) +
             " but the zero point is " + TypeName(zt) + "; valid: the same type for both");
    return new QdqKernel(api, r, quantize, axis);
  }

 private:
  QdqKernel(const OrtApi& api, const InfoReader& r, bool quantize, int64_t axis)
      : KernelBase(api, r.label()), quantize_(quantize), axis_(axis) {
    for (size_t i = 0; i < 3; ++i) names_[i] = r.InputName(i);
  }

  // Expands a per-tensor or per-channel parameter to `channels` values (or checks its layout).
  struct Param {
    int64_t numel = 0;
    bool per_channel = false;
  };
  Param Layout(const std::vector<int64_t>& shape, const char* role, size_t index) const {
    Param p;
    p.numel = 1;
    for (int64_t d : shape) p.numel *= d;
    if (p.numel == 1 && shape.size() <= 1) return p;
    if (shape.size() != 1) {
      Fail(std::string("input '") + role + "' ('" + names_[index] + "') has shape " + ShapeString(shape) +
           "; valid: a scalar or one-element tensor (per tensor) or a 1-D tensor along attribute 'axis' (per channel)");
    }
    p.per_channel = true;
    return p;
  }

  void Compute(OrtKernelContext* context) override {
    Ort::KernelContext ctx(context);
    Ort::ConstValue x = ctx.GetInput(0);
    Ort::ConstValue s = ctx.GetInput(1);
    Ort::ConstValue z = ctx.GetInput(2);
    if (!s) Fail("input 'scale' is missing; valid: a float32 scale (scalar or 1-D per channel)");
    if (!z) Fail("input 'zero_point' is missing; valid: a zero point whose type (" + std::string(kQdqTypes) +
                 ") selects the quantized type");
    const auto xi = x.GetTensorTypeAndShapeInfo();
    const auto si = s.GetTensorTypeAndShapeInfo();
    const auto zi = z.GetTensorTypeAndShapeInfo();
    const std::vector<int64_t> xshape = xi.GetShape();
    const ONNXTensorElementDataType zt = zi.GetElementType();
    const ONNXTensorElementDataType xt = xi.GetElementType();
    if (!IsQdqType(zt))
      Fail(std::string("input 'zero_point' ('") + names_[2] + "') has element type " + TypeName(zt) + "; valid: " + kQdqTypes);
    if (quantize_ && xt != kFloat)
      Fail(std::string("input 'x' ('") + names_[0] + "') has element type " + TypeName(xt) + "; valid: float32");
    if (!quantize_ && xt != zt)
      Fail(std::string("input 'x' ('") + names_[0] + "') has element type " + TypeName(xt) + " but the zero point is " +
           TypeName(zt) + "; valid: the same type for both");
    if (si.GetElementType() != kFloat)
      Fail(std::string("input 'scale' ('") + names_[1] + "') has element type " + TypeName(si.GetElementType()) +
           "; valid: float32");

    const Param sp = Layout(si.GetShape(), "scale", 1);
    const Param zp = Layout(zi.GetShape(), "zero_point", 2);
    const int64_t rank = static_cast<int64_t>(xshape.size());
    int64_t channels = 1, inner = 1;
    if (sp.per_channel || zp.per_channel) {
      if (axis_ < -rank || axis_ >= rank) {
        std::ostringstream os;
        os << "attribute 'axis'=" << axis_ << " is out of range for the rank-" << rank << " input 'x' ('" << names_[0]
           << "') with per-channel parameters; valid: integers in [" << -rank << ", " << rank - 1 << "]";
        Fail(os.str());
      }
      const int64_t ax = axis_ < 0 ? axis_ + rank : axis_;
      channels = xshape[ax];
      for (int64_t d = ax + 1; d < rank; ++d) inner *= xshape[d];
      const Param* ps[2] = {&sp, &zp};
      const char* roles[2] = {"scale", "zero_point"};
      for (int k = 0; k < 2; ++k) {
        if (ps[k]->per_channel && ps[k]->numel != channels) {
          std::ostringstream os;
          os << "input '" << roles[k] << "' ('" << names_[1 + k] << "') has " << ps[k]->numel
             << " elements but input 'x' has " << channels << " along attribute 'axis'=" << axis_
             << "; valid: one element (per tensor) or " << channels << " (per channel)";
          Fail(os.str());
        }
      }
    }
    int64_t numel = 1;
    for (int64_t d : xshape) numel *= d;
    OrtRunner runner(api_, context);

    // Parameters expanded to one value per channel (the scale and zero point are tiny).
    std::vector<float> scale(static_cast<size_t>(channels));
    const float* sd = s.GetTensorData<float>();
    for (int64_t c = 0; c < channels; ++c) scale[c] = sd[sp.per_channel ? c : 0];

    if (quantize_) {
      Ort::UnownedValue y = ctx.GetOutput(0, xshape.data(), xshape.size());
      if (numel == 0) return;
      const float* xd = x.GetTensorData<float>();
      QuantizeAs(zt, xd, y, z, zp.per_channel, channels, inner, numel, scale, runner);
    } else {
      Ort::UnownedValue y = ctx.GetOutput(0, xshape.data(), xshape.size());
      if (numel == 0) return;
      float* yd = y.GetTensorMutableData<float>();
      DequantizeAs(zt, x, yd, z, zp.per_channel, channels, inner, numel, scale, runner);
    }
  }

  template <typename Q>
  static std::vector<Q> Expand(const Ort::ConstValue& z, bool per_channel, int64_t channels) {
    const Q* zd = reinterpret_cast<const Q*>(z.GetTensorRawData());
    std::vector<Q> out(static_cast<size_t>(channels));
    for (int64_t c = 0; c < channels; ++c) out[c] = zd[per_channel ? c : 0];
    return out;
  }

  template <typename Q>
  void QuantizeInt(const float* xd, Ort::UnownedValue& y, const Ort::ConstValue& z, bool zpc, int64_t channels,
                   int64_t inner, int64_t numel, const std::vector<float>& scale, const TaskRunner& runner) {
    using Acc = typename std::conditional<(sizeof(Q) <= 2), float, double>::type;
    const std::vector<Q> zq = Expand<Q>(z, zpc, channels);
    std::vector<Acc> zd(zq.begin(), zq.end());
    IntQuantize<Q, Acc> fn{scale.data(), zd.data()};
    RunElementwise(xd, static_cast<Q*>(y.GetTensorMutableRawData()), numel, channels, inner, fn, runner);
  }

  template <typename Q>
  void DequantizeInt(const Ort::ConstValue& x, float* yd, const Ort::ConstValue& z, bool zpc, int64_t channels,
                     int64_t inner, int64_t numel, const std::vector<float>& scale, const TaskRunner& runner) {
    using Acc = typename std::conditional<(sizeof(Q) <= 2), int32_t, int64_t>::type;
    const std::vector<Q> zq = Expand<Q>(z, zpc, channels);
    std::vector<Acc> zd(zq.begin(), zq.end());
    IntDequantize<Q, Acc> fn{scale.data(), zd.data()};
    RunElementwise(reinterpret_cast<const Q*>(x.GetTensorRawData()), yd, numel, channels, inner, fn, runner);
  }

  void QuantizeAs(ONNXTensorElementDataType zt, const float* xd, Ort::UnownedValue& y, const Ort::ConstValue& z,
                  bool zpc, int64_t channels, int64_t inner, int64_t numel, const std::vector<float>& scale,
                  const TaskRunner& runner) {
    switch (zt) {
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return QuantizeInt<int8_t>(xd, y, z, zpc, channels, inner, numel, scale, runner);
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return QuantizeInt<uint8_t>(xd, y, z, zpc, channels, inner, numel, scale, runner);
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16: return QuantizeInt<int16_t>(xd, y, z, zpc, channels, inner, numel, scale, runner);
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16: return QuantizeInt<uint16_t>(xd, y, z, zpc, channels, inner, numel, scale, runner);
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return QuantizeInt<int32_t>(xd, y, z, zpc, channels, inner, numel, scale, runner);
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32: return QuantizeInt<uint32_t>(xd, y, z, zpc, channels, inner, numel, scale, runner);
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: {
        const std::vector<uint16_t> zq = Expand<uint16_t>(z, zpc, channels);
        std::vector<float> zf(zq.size());
        for (size_t c = 0; c < zq.size(); ++c) zf[c] = bfloat16_to_float(zq[c]);
        Bf16Quantize fn{scale.data(), zf.data()};
        RunElementwise(xd, static_cast<uint16_t*>(y.GetTensorMutableRawData()), numel, channels, inner, fn, runner);
        return;
      }
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: {
        RunElementwise(xd, static_cast<uint16_t*>(y.GetTensorMutableRawData()), numel, int64_t{1}, int64_t{1},
                       Fp16Quantize{}, runner);
        return;
      }
      default: Fail(std::string("unsupported zero-point type ") + TypeName(zt) + "; valid: " + kQdqTypes);
    }
  }

  void DequantizeAs(ONNXTensorElementDataType zt, const Ort::ConstValue& x, float* yd, const Ort::ConstValue& z,
                    bool zpc, int64_t channels, int64_t inner, int64_t numel, const std::vector<float>& scale,
                    const TaskRunner& runner) {
    switch (zt) {
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return DequantizeInt<int8_t>(x, yd, z, zpc, channels, inner, numel, scale, runner);
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return DequantizeInt<uint8_t>(x, yd, z, zpc, channels, inner, numel, scale, runner);
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16: return DequantizeInt<int16_t>(x, yd, z, zpc, channels, inner, numel, scale, runner);
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16: return DequantizeInt<uint16_t>(x, yd, z, zpc, channels, inner, numel, scale, runner);
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return DequantizeInt<int32_t>(x, yd, z, zpc, channels, inner, numel, scale, runner);
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32: return DequantizeInt<uint32_t>(x, yd, z, zpc, channels, inner, numel, scale, runner);
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: {
        const std::vector<uint16_t> zq = Expand<uint16_t>(z, zpc, channels);
        std::vector<float> zf(zq.size());
        for (size_t c = 0; c < zq.size(); ++c) zf[c] = bfloat16_to_float(zq[c]);
        Bf16Dequantize fn{scale.data(), zf.data()};
        RunElementwise(reinterpret_cast<const uint16_t*>(x.GetTensorRawData()), yd, numel, channels, inner, fn, runner);
        return;
      }
      case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
        RunElementwise(reinterpret_cast<const uint16_t*>(x.GetTensorRawData()), yd, numel, int64_t{1}, int64_t{1},
                       Fp16Dequantize{}, runner);
        return;
      default: Fail(std::string("unsupported zero-point type ") + TypeName(zt) + "; valid: " + kQdqTypes);
    }
  }

  bool quantize_;
  int64_t axis_;
  std::string names_[3];
};

// ---------------------------------------------------------------------------------------------------
// Type and shape inference: the output has input 0's shape, and the input's type for the block operators,
// the zero point's type for ExtendedQuantizeLinear, float32 for ExtendedDequantizeLinear (ONNX Runtime
// also propagates these types itself for dynamically typed inputs; recent runtimes take the element type
// from the info set here, so it must be right). Implemented on the C API: the 1.17 C++ wrapper
// ShapeInferContext::SetOutputShape writes every static dimension as 1.
// ---------------------------------------------------------------------------------------------------
OrtStatusPtr InferOutput(OpKind kind, OrtShapeInferContext* ctx) {
  const OrtApi& api = Ort::GetApi();
  size_t n_inputs = 0;
  if (OrtStatus* st = api.ShapeInferContext_GetInputCount(ctx, &n_inputs)) return st;
  if (n_inputs == 0) return nullptr;
  OrtTensorTypeAndShapeInfo* in = nullptr;  // owned by the context
  if (OrtStatus* st = api.ShapeInferContext_GetInputTypeShape(ctx, 0, &in)) return st;
  ONNXTensorElementDataType type = kFloat;
  if (kind == OpKind::kBfp || kind == OpKind::kMx) {
    if (OrtStatus* st = api.GetTensorElementType(in, &type)) return st;
  } else if (kind == OpKind::kQuantize) {
    if (n_inputs < 3) return nullptr;
    OrtTensorTypeAndShapeInfo* zp = nullptr;
    if (OrtStatus* st = api.ShapeInferContext_GetInputTypeShape(ctx, 2, &zp)) return st;
    if (OrtStatus* st = api.GetTensorElementType(zp, &type)) return st;
  }
  if (type == kUndefined) return nullptr;
  size_t rank = 0;
  if (OrtStatus* st = api.GetDimensionsCount(in, &rank)) return st;
  // ONNX Runtime reports an unknown shape as rank 0, indistinguishable from a scalar: leave it to the runtime.
  if (rank == 0) return nullptr;
  std::vector<int64_t> dims(rank);
  std::vector<const char*> syms(rank, nullptr);
  if (OrtStatus* st = api.GetDimensions(in, dims.data(), rank)) return st;
  if (OrtStatus* st = api.GetSymbolicDimensions(in, syms.data(), rank)) return st;
  for (size_t i = 0; i < rank; ++i) {
    // a dimension that is neither known nor named cannot be expressed through this API: leave the shape
    // to ONNX Runtime rather than write a negative dimension
    if (dims[i] < 0 && (syms[i] == nullptr || syms[i][0] == '\0')) return nullptr;
    if (syms[i] == nullptr) syms[i] = "";
  }
  OrtTensorTypeAndShapeInfo* out = nullptr;
  if (OrtStatus* st = api.CreateTensorTypeAndShapeInfo(&out)) return st;
  OrtStatus* st = api.SetTensorElementType(out, type);
  if (st == nullptr) st = api.SetDimensions(out, dims.data(), rank);
  if (st == nullptr) st = api.SetSymbolicDimensions(out, syms.data(), rank);
  if (st == nullptr) st = api.ShapeInferContext_SetOutputTypeShape(ctx, 0, out);
  api.ReleaseTensorTypeAndShapeInfo(out);
  return st;
}

// ---------------------------------------------------------------------------------------------------
// The custom-op descriptions (one object per name and domain).
// ---------------------------------------------------------------------------------------------------
struct QuarkOp : Ort::CustomOpBase<QuarkOp, KernelBase, true> {
  QuarkOp(OpKind kind, const char* name, const char* domain) : kind_(kind), name_(name), domain_(domain) {
    OrtCustomOp::InferOutputShapeFn = &InferShape;
  }

  static OrtStatusPtr ORT_API_CALL InferShape(const OrtCustomOp* op, OrtShapeInferContext* ctx) {
    try {
      return InferOutput(static_cast<const QuarkOp*>(op)->kind_, ctx);
    } catch (...) {  // never let an exception cross the C API
      return Ort::GetApi().CreateStatus(ORT_FAIL, "qtorch-onnx operator library: shape inference failed");
    }
  }

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    *kernel = nullptr;
    try {
      InfoReader reader(api, info, domain_, name_);
      switch (kind_) {
        case OpKind::kBfp: *kernel = BfpKernel::Create(api, reader); break;
        case OpKind::kMx: *kernel = MxKernel::Create(api, reader); break;
        case OpKind::kQuantize: *kernel = QdqKernel::Create(api, reader, true); break;
        case OpKind::kDequantize: *kernel = QdqKernel::Create(api, reader, false); break;
      }
      return nullptr;
    } catch (const KernelError& e) {
      return api.CreateStatus(ORT_INVALID_ARGUMENT, e.what());
    } catch (const std::exception& e) {
      return api.CreateStatus(ORT_FAIL, (std::string(domain_) + "::" + name_ + ": " + e.what()).c_str());
    } catch (...) {
      return api.CreateStatus(ORT_FAIL, (std::string(domain_) + "::" + name_ + ": unknown error").c_str());
    }
  }

  const char* GetName() const { return name_; }
  const char* domain() const { return domain_; }

  size_t GetInputTypeCount() const { return (kind_ == OpKind::kBfp || kind_ == OpKind::kMx) ? 1 : 3; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    switch (kind_) {
      case OpKind::kBfp:
      case OpKind::kMx: return kUndefined;                       // float32 or float16, checked by the kernel
      case OpKind::kQuantize: return index == 2 ? kUndefined : kFloat;  // x, scale: float32; zero_point: any Q type
      case OpKind::kDequantize: return index == 1 ? kFloat : kUndefined;  // x and zero_point: the Q type
    }
    return kUndefined;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const {
    // block ops: the input's type; Quantize: the zero point's type (both propagated by ONNX Runtime)
    return kind_ == OpKind::kDequantize ? kFloat : kUndefined;
  }

 private:
  OpKind kind_;
  const char* name_;
  const char* domain_;
};

constexpr const char* kQuarkDomain = "com.amd.quark";
constexpr const char* kVaiDomain = "com.vai.quantize";

const QuarkOp kOps[] = {
    QuarkOp(OpKind::kBfp, "BFPQuantizeDequantize", kQuarkDomain),
    QuarkOp(OpKind::kMx, "MXQuantizeDequantize", kQuarkDomain),
    QuarkOp(OpKind::kQuantize, "ExtendedQuantizeLinear", kQuarkDomain),
    QuarkOp(OpKind::kDequantize, "ExtendedDequantizeLinear", kQuarkDomain),
    QuarkOp(OpKind::kBfp, "BFPFixNeuron", kVaiDomain),
    QuarkOp(OpKind::kMx, "MXFixNeuron", kVaiDomain),
    QuarkOp(OpKind::kQuantize, "VitisQuantizeLinear", kVaiDomain),
    QuarkOp(OpKind::kDequantize, "VitisDequantizeLinear", kVaiDomain),
};

std::mutex g_domains_mutex;
std::vector<OrtCustomOpDomain*> g_domains;  // created once per load, shared by every session (never freed:
                                            // ONNX Runtime keeps pointers to them for the sessions' lifetime)

OrtStatus* CreateDomains(const OrtApi& api) {
  if (!g_domains.empty()) return nullptr;
  for (const char* name : {kQuarkDomain, kVaiDomain}) {
    OrtCustomOpDomain* domain = nullptr;
    if (OrtStatus* st = api.CreateCustomOpDomain(name, &domain)) return st;
    for (const QuarkOp& op : kOps) {
      if (std::strcmp(op.domain(), name) != 0) continue;
      if (OrtStatus* st = api.CustomOpDomain_Add(domain, const_cast<QuarkOp*>(&op))) {
        api.ReleaseCustomOpDomain(domain);
        return st;
      }
    }
    g_domains.push_back(domain);
  }
  return nullptr;
}

}  // namespace
}  // namespace qtorch_ort

extern "C" QTORCH_ORT_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                         const OrtApiBase* api_base) {
  if (api_base == nullptr) return nullptr;
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    const OrtApi* api1 = api_base->GetApi(1);
    if (api1 == nullptr) return nullptr;
    std::string msg = "qtorch-onnx operator library: this ONNX Runtime (" + std::string(api_base->GetVersionString()) +
                      ") does not provide API version " + std::to_string(ORT_API_VERSION) +
                      "; valid: ONNX Runtime 1." + std::to_string(ORT_API_VERSION) + " or newer";
    return api1->CreateStatus(ORT_FAIL, msg.c_str());
  }
  Ort::InitApi(api);
  std::lock_guard<std::mutex> lock(qtorch_ort::g_domains_mutex);
  if (OrtStatus* st = qtorch_ort::CreateDomains(*api)) return st;
  for (OrtCustomOpDomain* domain : qtorch_ort::g_domains) {
    if (OrtStatus* st = api->AddCustomOpDomain(options, domain)) return st;
  }
  return nullptr;
}

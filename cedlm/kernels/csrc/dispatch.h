// The custom ops torch.ops.cedlm.* (defined in cedlm/kernels/ops.py) as C++ kernels of torch's
// dispatcher, for the CPU.
//
// Why: the compiled decode, verify and draft steps call these ops from inductor's generated C++
// wrapper through the dispatcher (callBoxed). With only ops.py's Python kernels registered, each
// call crosses back into the interpreter (about 18 us for a one-row encode against 1.8 us for the
// same kernel called directly; 48 such calls per decoded token). Registered here, the same call
// stays in C++.
//
// How it stays the same op: ops.py registers its Python kernels under CompositeExplicitAutograd,
// so they serve every device; this file registers a CPU kernel of each op once the gate has
// accepted the module (register_ops), which the dispatcher prefers for CPU tensors. Each CPU
// kernel here runs the extension's function exactly as the Python kernel would (the same
// reshape / float / contiguous conversions, the same functions of this module) when the gate's
// answer is "ext" (set_ops_enabled: gate.py keeps it in step with the reference switch and the
// fast backend) and the format is one the extension codes; otherwise it calls the Python kernel
// (under the GIL), which runs the torch codecs or the readable reference. So the results are
// those of the Python kernels, bit for bit, in both cases (tests/test_kernel_dispatch.py).
#pragma once

#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>

namespace cedlm_dispatch {

namespace py = pybind11;

struct State {
  bool enabled = false;                                            // gate.active_backend() == "ext"
  std::unordered_map<std::string, std::pair<int64_t, int64_t>> formats;   // name -> (kind, block)
  std::unordered_map<std::string, py::object*> fallback;           // op name -> Python kernel
  std::unique_ptr<torch::Library> lib;                             // the CPU registrations
};

inline State& state() {
  static State* s = new State();          // never destroyed: outlives the interpreter's objects
  return *s;
}

// (kind, block) of a format name the extension codes; "" is a float32 row store (-1, 0).
inline bool kind_of(c10::string_view fmt, bool allow_float, std::pair<int64_t, int64_t>* out) {
  if (fmt.empty()) {
    *out = {-1, 0};
    return allow_float;
  }
  auto& f = state().formats;
  auto it = f.find(std::string(fmt.data(), fmt.size()));
  if (it == f.end()) return false;
  *out = it->second;
  return true;
}

inline bool on_cpu(std::initializer_list<const at::Tensor*> ts) {
  for (auto* t : ts)
    if (!t->device().is_cpu()) return false;
  return true;
}

template <typename R, typename... Args>
R call_python(const char* name, Args&&... args) {
  py::gil_scoped_acquire gil;
  auto& fb = state().fallback;
  auto it = fb.find(name);
  TORCH_CHECK(it != fb.end(), "cedlm::", name, ": no Python kernel registered");
  return (*it->second)(std::forward<Args>(args)...).template cast<R>();
}

inline std::string str(c10::string_view s) { return std::string(s.data(), s.size()); }

inline std::vector<int64_t> with_last(const at::Tensor& t, int64_t last) {
  auto shape = t.sizes().vec();
  if (shape.empty()) shape.push_back(last); else shape.back() = last;
  return shape;
}

// ---------------------------------------------------------------- the CPU kernels
inline at::Tensor k_encode(const at::Tensor& x, c10::string_view fmt) {
  std::pair<int64_t, int64_t> kb;
  if (!state().enabled || !kind_of(fmt, false, &kb))
    return call_python<at::Tensor>("encode", x, str(fmt));
  const int64_t dim = x.size(-1);
  at::Tensor out = encode(x.reshape({-1, dim}).to(at::kFloat).contiguous(), kb.first, kb.second);
  return out.view(with_last(x, out.size(-1)));   // stated: zero rows keep their width
}

inline at::Tensor k_decode(const at::Tensor& b, c10::string_view fmt, int64_t dim) {
  std::pair<int64_t, int64_t> kb;
  if (!state().enabled || !kind_of(fmt, false, &kb))
    return call_python<at::Tensor>("decode", b, str(fmt), dim);
  at::Tensor out = decode(b.reshape({-1, b.size(-1)}).contiguous(), kb.first, dim, kb.second);
  return out.view(with_last(b, dim));
}

inline at::Tensor k_quant_dequant(const at::Tensor& x, c10::string_view fmt) {
  std::pair<int64_t, int64_t> kb;
  if (!state().enabled || !kind_of(fmt, false, &kb))
    return call_python<at::Tensor>("quant_dequant", x, str(fmt));
  at::Tensor out = quant_dequant(x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous(),
                                 kb.first, kb.second);
  return out.view(x.sizes());
}

inline at::Tensor k_index_score(const at::Tensor& q, const at::Tensor& w, const at::Tensor& raw,
                                const at::Tensor& visible, c10::string_view fmt) {
  std::pair<int64_t, int64_t> kb;
  if (!state().enabled || !kind_of(fmt, false, &kb) || !on_cpu({&q, &w, &raw, &visible}) ||
      raw.size(-2) == 0)
    return call_python<at::Tensor>("index_score", q, w, raw, visible, str(fmt));
  return index_score(q.to(at::kFloat).contiguous(), w.to(at::kFloat).contiguous(),
                     raw.contiguous(), visible.contiguous(), kb.first, kb.second);
}

inline std::tuple<at::Tensor, at::Tensor> k_stable_topk(const at::Tensor& score, int64_t k) {
  if (!state().enabled || score.scalar_type() != at::kFloat)
    return call_python<std::tuple<at::Tensor, at::Tensor>>("stable_topk", score, k);
  auto r = stable_topk(score.contiguous(), k);
  return {r[0], r[1]};
}

inline at::Tensor k_attend(const at::Tensor& q, const at::Tensor& win_k,
                           const at::Tensor& win_valid, const at::Tensor& comp_k,
                           const at::Tensor& comp_valid, const at::Tensor& sink, double scale) {
  if (!state().enabled || !on_cpu({&q, &win_k, &win_valid, &comp_k, &comp_valid, &sink}))
    return call_python<at::Tensor>("attend", q, win_k, win_valid, comp_k, comp_valid, sink, scale);
  return attend_sparse(q.to(at::kFloat).contiguous(), win_k.to(at::kFloat).contiguous(),
                       win_valid.contiguous(), comp_k.to(at::kFloat).contiguous(),
                       comp_valid.contiguous(), sink.to(at::kFloat).contiguous(), scale);
}

inline at::Tensor k_attend_packed(const at::Tensor& q, const at::Tensor& win_rows,
                                  const at::Tensor& win_idx, const at::Tensor& win_valid,
                                  c10::string_view win_fmt, const at::Tensor& comp_rows,
                                  const at::Tensor& comp_idx, const at::Tensor& comp_valid,
                                  c10::string_view comp_fmt, const at::Tensor& sink, double scale) {
  std::pair<int64_t, int64_t> wk, ck;
  if (!state().enabled || !kind_of(win_fmt, true, &wk) || !kind_of(comp_fmt, true, &ck) ||
      !on_cpu({&q, &win_rows, &win_idx, &win_valid, &comp_rows, &comp_idx, &comp_valid, &sink}))
    return call_python<at::Tensor>("attend_packed", q, win_rows, win_idx, win_valid, str(win_fmt),
                                   comp_rows, comp_idx, comp_valid, str(comp_fmt), sink, scale);
  return attend_packed(q.to(at::kFloat).contiguous(), win_rows, win_idx.contiguous(),
                       win_valid.contiguous(), wk.first, wk.second, comp_rows,
                       comp_idx.contiguous(), comp_valid.contiguous(), ck.first, ck.second,
                       sink.to(at::kFloat).contiguous(), scale);
}

}  // namespace cedlm_dispatch

// Register the CPU kernels (once per process; later calls only refresh the tables): formats
// maps each format name the extension codes to (kind, block); fallbacks maps each op name to its
// Python kernel (ops.py), which these call when the gate's answer is not "ext". Returns the op
// names registered.
inline std::vector<std::string> register_ops(py::dict formats, py::dict fallbacks) {
  using namespace cedlm_dispatch;
  State& s = state();
  for (auto item : formats) {
    auto kb = item.second.cast<std::pair<int64_t, int64_t>>();
    s.formats[item.first.cast<std::string>()] = kb;
  }
  for (auto item : fallbacks) {
    const std::string name = item.first.cast<std::string>();
    auto it = s.fallback.find(name);
    if (it != s.fallback.end()) delete it->second;
    s.fallback[name] = new py::object(py::reinterpret_borrow<py::object>(item.second));
  }
  if (!s.lib) {
    s.lib = std::make_unique<torch::Library>(torch::Library::IMPL, "cedlm",
                                             std::make_optional(c10::DispatchKey::CPU),
                                             __FILE__, __LINE__);
    s.lib->impl("encode", TORCH_FN(k_encode));
    s.lib->impl("decode", TORCH_FN(k_decode));
    s.lib->impl("quant_dequant", TORCH_FN(k_quant_dequant));
    s.lib->impl("index_score", TORCH_FN(k_index_score));
    s.lib->impl("stable_topk", TORCH_FN(k_stable_topk));
    s.lib->impl("attend", TORCH_FN(k_attend));
    s.lib->impl("attend_packed", TORCH_FN(k_attend_packed));
  }
  return {"encode", "decode", "quant_dequant", "index_score", "stable_topk", "attend",
          "attend_packed"};
}

// Whether the CPU kernels run the extension (true) or call the Python kernels (false); returns
// the previous setting. gate.py sets it to gate.active_backend() == "ext".
inline bool set_ops_enabled(bool on) {
  bool prev = cedlm_dispatch::state().enabled;
  cedlm_dispatch::state().enabled = on;
  return prev;
}

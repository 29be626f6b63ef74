// The CPU step's custom ops as C++ torch operators (namespace pdserve_cpu), so that a
// compiled step calls its linears and attention without entering Python: with inductor's
// C++ wrapper the whole decode step runs as one call without the GIL.
// Built and loaded by kernels/cpu_build.py, linked against the variants of the attention,
// sgemm and gemm kernels that this CPU runs (their interface: pdserve_kernels.h); the Python
// side is services/engine/model/ops.py.
//
// Attention reads the step's KV cache and metadata from a per-thread context that
// set_step() fills before each forward (each engine steps on its own thread). Decode rows
// run the C kernel on the paged cache in place; prefill rows (a chunk of a prompt) call
// back into the Python op pdserve::prefill_attention, which reads the forward context.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "pdserve_kernels.h"

namespace {

struct StepContext {
    bool set = false;
    at::Tensor kv;            // [blocks, layers, 2, kv_heads, block_size, head_dim]
    at::Tensor slot_mapping;  // [tokens] int64
    at::Tensor block_tables;  // [decode rows, max_blocks] int32
    at::Tensor seq_lens;      // [decode rows] int32
    int64_t num_decode = 0;
};

thread_local StepContext step;

void set_step(const at::Tensor& kv, const at::Tensor& slot_mapping,
              const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_decode) {
    TORCH_CHECK(kv.dim() == 6 && kv.stride(5) == 1,
                "pdserve_cpu: the KV cache must be [blocks, layers, 2, kv_heads, block_size, "
                "head_dim] with head_dim contiguous");
    TORCH_CHECK(kv.scalar_type() == at::kFloat || kv.scalar_type() == at::kBFloat16,
                "pdserve_cpu: the KV cache must be float32 or bfloat16");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
                "pdserve_cpu: slot_mapping must be contiguous int64");
    if (num_decode > 0) {
        TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1 &&
                        block_tables.size(0) == num_decode,
                    "pdserve_cpu: block_tables must be int32 [num_decode, max_blocks] rows");
        TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                        seq_lens.size(0) == num_decode,
                    "pdserve_cpu: seq_lens must be contiguous int32 [num_decode]");
    }
    step.kv = kv;
    step.slot_mapping = slot_mapping;
    step.block_tables = block_tables;
    step.seq_lens = seq_lens;
    step.num_decode = num_decode;
    step.set = true;
}

void clear_step() { step = StepContext(); }

at::Tensor prefill_fallback(const at::Tensor& q, int64_t layer, double scale, int64_t window) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("pdserve::prefill_attention", "")
                         .typed<at::Tensor(const at::Tensor&, int64_t, double, int64_t)>();
    return op.call(q, layer, scale, window);
}

// window > 0: a query at position p attends keys p - window < j <= p (0: the whole context).
at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     int64_t layer, double scale, int64_t window) {
    TORCH_CHECK(step.set, "bug: pdserve_cpu::attention ran outside a step (no set_step)");
    const at::Tensor& kv = step.kv;
    const auto dtype = kv.scalar_type();
    const int64_t n = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
    const int64_t hkv = key.size(1), block_size = kv.size(4);
    TORCH_CHECK(layer >= 0 && layer < kv.size(1), "pdserve_cpu: no layer ", layer);
    TORCH_CHECK(window >= 0 && window <= INT32_MAX,
                "pdserve_cpu: a window is 0 (none) or a token count, not ", window);
    TORCH_CHECK(step.slot_mapping.size(0) == n, "pdserve_cpu: the step has ",
                step.slot_mapping.size(0), " tokens, attention got ", n);
    TORCH_CHECK(key.size(2) == head_dim && kv.size(5) == head_dim && kv.size(3) == hkv,
                "pdserve_cpu: K/V shapes do not match the cache");
    at::Tensor k = key.to(dtype), v = value.to(dtype);
    if (k.stride(2) != 1) k = k.contiguous();
    if (v.stride(2) != 1) v = v.contiguous();
    // This layer's K and V as [blocks, block_size, kv_heads, head_dim] strided views.
    const int64_t s_block = kv.stride(0), s_tok = kv.stride(4), s_head = kv.stride(3);
    const int64_t offset = layer * kv.stride(1);
    const int64_t v_offset = offset + kv.stride(2);
    const int64_t* slots = step.slot_mapping.data_ptr<int64_t>();
    const int nd = static_cast<int>(step.num_decode);
    at::Tensor out = at::zeros({n, num_heads, head_dim}, kv.options());
    const int threads = at::get_num_threads();
    if (dtype == at::kFloat) {
        float* base = kv.data_ptr<float>();
        pd_write_kv_f32(k.data_ptr<float>(), v.data_ptr<float>(), k.stride(0), k.stride(1),
                        v.stride(0), v.stride(1), base + offset, base + v_offset, s_block, s_tok,
                        s_head, slots, n, hkv, head_dim, block_size);
    } else {
        auto* base = reinterpret_cast<uint16_t*>(kv.data_ptr<at::BFloat16>());
        pd_write_kv_bf16(reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
                         reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()),
                         k.stride(0), k.stride(1), v.stride(0), v.stride(1), base + offset,
                         base + v_offset, s_block, s_tok, s_head, slots, n, hkv, head_dim,
                         block_size);
    }
    if (nd > 0) {
        at::Tensor q = query.narrow(0, 0, nd).to(dtype);
        if (q.stride(2) != 1) q = q.contiguous();
        const int32_t* tables = step.block_tables.data_ptr<int32_t>();
        const int64_t tables_s = step.block_tables.stride(0);
        const int32_t* lens = step.seq_lens.data_ptr<int32_t>();
        if (dtype == at::kFloat) {
            const float* base = kv.data_ptr<float>();
            pd_decode_attention_f32(q.data_ptr<float>(), q.stride(0), q.stride(1), base + offset,
                                    base + v_offset, s_block, s_tok, s_head, tables, tables_s,
                                    lens, nd, num_heads, hkv, head_dim, block_size,
                                    static_cast<int>(window), static_cast<float>(scale),
                                    out.data_ptr<float>(), threads);
        } else {
            const auto* base = reinterpret_cast<const uint16_t*>(kv.data_ptr<at::BFloat16>());
            pd_decode_attention_bf16(
                reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), q.stride(0),
                q.stride(1), base + offset, base + v_offset, s_block, s_tok, s_head, tables,
                tables_s, lens, nd, num_heads, hkv, head_dim, block_size,
                static_cast<int>(window), static_cast<float>(scale),
                reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), threads);
        }
    }
    if (nd < n) {
        out.narrow(0, nd, n - nd)
            .copy_(prefill_fallback(query.narrow(0, nd, n - nd), layer, scale, window));
    }
    return out.scalar_type() == query.scalar_type() ? out : out.to(query.scalar_type());
}

// The kernel weight (cpu_sgemm.c's panels for float32, cpu_gemm.c's AMX tiles for bf16)
// takes up to kernel_max_rows rows, and every row count when there is no oneDNN weight.
at::Tensor linear(const at::Tensor& x, const std::optional<at::Tensor>& onednn_weight,
                  const std::optional<at::Tensor>& kernel_weight,
                  const std::optional<at::Tensor>& bias, int64_t out_features,
                  int64_t kernel_max_rows) {
    at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
    const int64_t m = xc.size(0), k = xc.size(1);
    const bool kernel = kernel_weight.has_value() &&
                        (m <= kernel_max_rows || !onednn_weight.has_value()) &&
                        xc.scalar_type() == kernel_weight->scalar_type();
    if (kernel && xc.scalar_type() == at::kFloat) {
        TORCH_CHECK(kernel_weight->numel() == k * out_features,
                    "pdserve_cpu::linear: the packed weight is not [", out_features, ", ", k, "]");
        at::Tensor y = at::empty({m, out_features}, xc.options());
        at::Tensor b;
        if (bias.has_value()) b = bias->to(at::kFloat).contiguous();
        pd_sgemm_linear(xc.data_ptr<float>(), kernel_weight->data_ptr<float>(),
                        b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(),
                        static_cast<int>(m), static_cast<int>(out_features), static_cast<int>(k),
                        at::get_num_threads());
        return y;
    }
    if (kernel && xc.scalar_type() == at::kBFloat16) {
        at::Tensor y = at::empty({m, out_features}, xc.options());
        at::Tensor b;
        if (bias.has_value()) b = bias->to(at::kBFloat16).contiguous();
        pd_amx_linear(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()),
                      reinterpret_cast<const uint16_t*>(kernel_weight->data_ptr<at::BFloat16>()),
                      b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>())
                                  : nullptr,
                      reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
                      static_cast<int>(m), static_cast<int>(out_features), static_cast<int>(k),
                      at::get_num_threads());
        return y;
    }
    TORCH_CHECK(onednn_weight.has_value(),
                "bug: pdserve_cpu::linear has no weight for a ", xc.scalar_type(), " input");
    static auto op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&, c10::string_view,
                              c10::List<std::optional<at::Scalar>>,
                              std::optional<c10::string_view>)>();
    return op.call(xc, *onednn_weight, bias, "none", c10::List<std::optional<at::Scalar>>(),
                   "");
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
    m.def("set_step(Tensor kv, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
          "int num_decode) -> ()");
    m.def("clear_step() -> ()");
    m.def("attention(Tensor query, Tensor key, Tensor value, int layer, float scale, "
          "int window) -> Tensor");
    m.def("linear(Tensor x, Tensor? onednn_weight, Tensor? kernel_weight, Tensor? bias, "
          "int out_features, int kernel_max_rows) -> Tensor");
}

// One kernel for every backend key: a packed oneDNN weight is an MkldnnCPU tensor.
TORCH_LIBRARY_IMPL(pdserve_cpu, CompositeExplicitAutograd, m) {
    m.impl("set_step", &set_step);
    m.impl("clear_step", &clear_step);
    m.impl("attention", &attention);
    m.impl("linear", &linear);
}

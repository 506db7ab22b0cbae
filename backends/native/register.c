/* The library's entry point: onnxruntime's register_custom_ops_library calls it and
 * gets every op of the domain "hetero_sd.native". */
#include "ort_api.h"

extern OrtCustomOp slab_attention_op, block_matmul_op, gguf_matmul_op;

__attribute__((visibility("default")))
OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(API_VERSION);
  if (!api) return NULL;  /* an onnxruntime older than 1.17 cannot report an error either */
  OrtCustomOpDomain* dom;
  TRY(api->CreateCustomOpDomain("hetero_sd.native", &dom));
  TRY(api->CustomOpDomain_Add(dom, &slab_attention_op));
  TRY(api->CustomOpDomain_Add(dom, &block_matmul_op));
  TRY(api->CustomOpDomain_Add(dom, &gguf_matmul_op));
  return api->AddCustomOpDomain(options, dom);
}

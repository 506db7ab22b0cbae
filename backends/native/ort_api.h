/* The part of onnxruntime's C API our custom ops use, declared by slot: the wheel
 * installs no header. Each function sits at its fixed index in OrtApi, which the API
 * only ever appends to; the static asserts pin the indices. GetApi(17) is the first
 * version with KernelContext_ParallelFor. */
#ifndef HETERO_SD_ORT_API_H
#define HETERO_SD_ORT_API_H
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtTensorTypeAndShapeInfo OrtShape;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtSessionOptions OrtSessionOptions;

typedef struct OrtApi {
  OrtStatus* (*CreateStatus)(int code, const char* msg);                                  /* 0 */
  void* s1_25[25];
  OrtStatus* (*CreateCustomOpDomain)(const char*, OrtCustomOpDomain**);                   /* 26 */
  OrtStatus* (*CustomOpDomain_Add)(OrtCustomOpDomain*, const void* op);                   /* 27 */
  OrtStatus* (*AddCustomOpDomain)(OrtSessionOptions*, OrtCustomOpDomain*);                /* 28 */
  void* s29_50[22];
  OrtStatus* (*GetTensorMutableData)(OrtValue*, void**);                                  /* 51 */
  void* s52_60[9];
  OrtStatus* (*GetDimensionsCount)(const OrtShape*, size_t*);                             /* 61 */
  OrtStatus* (*GetDimensions)(const OrtShape*, int64_t*, size_t);                         /* 62 */
  void* s63_64[2];
  OrtStatus* (*GetTensorTypeAndShape)(const OrtValue*, OrtShape**);                       /* 65 */
  void* s66_84[19];
  OrtStatus* (*KernelInfoGetAttribute_float)(const OrtKernelInfo*, const char*, float*);  /* 85 */
  OrtStatus* (*KernelInfoGetAttribute_int64)(const OrtKernelInfo*, const char*, int64_t*);/* 86 */
  void* s87;
  OrtStatus* (*KernelContext_GetInputCount)(const OrtKernelContext*, size_t*);             /* 88 */
  void* s89;
  OrtStatus* (*KernelContext_GetInput)(const OrtKernelContext*, size_t, const OrtValue**); /* 90 */
  OrtStatus* (*KernelContext_GetOutput)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**); /* 91 */
  void* s92;
  void (*ReleaseStatus)(OrtStatus*);                                                      /* 93 */
  void* s94_98[5];
  void (*ReleaseTensorTypeAndShapeInfo)(OrtShape*);                                       /* 99 */
  void* s100_273[174];
  OrtStatus* (*KernelContext_ParallelFor)(const OrtKernelContext*, void (*)(void*, size_t),
                                          size_t, size_t, void*);                         /* 274 */
} OrtApi;
_Static_assert(offsetof(OrtApi, CreateCustomOpDomain) / sizeof(void*) == 26, "slot");
_Static_assert(offsetof(OrtApi, GetTensorMutableData) / sizeof(void*) == 51, "slot");
_Static_assert(offsetof(OrtApi, GetTensorTypeAndShape) / sizeof(void*) == 65, "slot");
_Static_assert(offsetof(OrtApi, KernelInfoGetAttribute_int64) / sizeof(void*) == 86, "slot");
_Static_assert(offsetof(OrtApi, KernelContext_GetInputCount) / sizeof(void*) == 88, "slot");
_Static_assert(offsetof(OrtApi, KernelContext_GetOutput) / sizeof(void*) == 91, "slot");
_Static_assert(offsetof(OrtApi, ReleaseTensorTypeAndShapeInfo) / sizeof(void*) == 99, "slot");
_Static_assert(offsetof(OrtApi, KernelContext_ParallelFor) / sizeof(void*) == 274, "slot");

typedef struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)(void);
} OrtApiBase;

typedef struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const struct OrtCustomOp*, const OrtApi*, const OrtKernelInfo*);
  const char* (*GetName)(const struct OrtCustomOp*);
  const char* (*GetExecutionProviderType)(const struct OrtCustomOp*);
  int (*GetInputType)(const struct OrtCustomOp*, size_t);
  size_t (*GetInputTypeCount)(const struct OrtCustomOp*);
  int (*GetOutputType)(const struct OrtCustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const struct OrtCustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  int (*GetInputCharacteristic)(const struct OrtCustomOp*, size_t);
  int (*GetOutputCharacteristic)(const struct OrtCustomOp*, size_t);
  int (*GetInputMemoryType)(const struct OrtCustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const struct OrtCustomOp*);
  int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp*);
  int (*GetVariadicOutputMinArity)(const struct OrtCustomOp*);
  int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp*);
  OrtStatus* (*CreateKernelV2)(const struct OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**);
  OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
  void* InferOutputShapeFn;
  int (*GetStartVersion)(const struct OrtCustomOp*);
  int (*GetEndVersion)(const struct OrtCustomOp*);
} OrtCustomOp;

enum { T_FLOAT = 1, T_UINT8 = 2, T_INT32 = 6, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2, API_VERSION = 17 };

static inline OrtStatus* dims(const OrtApi* api, const OrtValue* v, int64_t* out, size_t* n) {
  OrtShape* info;
  OrtStatus* st = api->GetTensorTypeAndShape(v, &info);
  if (st) return st;
  st = api->GetDimensionsCount(info, n);
  if (!st) st = *n <= 4 ? api->GetDimensions(info, out, *n) : api->CreateStatus(ORT_INVALID_ARGUMENT, "rank > 4");
  api->ReleaseTensorTypeAndShapeInfo(info);
  return st;
}

#define TRY(x) do { OrtStatus* st_ = (x); if (st_) return st_; } while (0)


/* the matmuls' quantized rows: one 64-byte aligned buffer a thread (block_matmul.c) */
void* matmul_scratch(size_t bytes);

/* a matmul's two passes: each row of A quantized (in parallel above 4 rows), then the
 * tiles, col_tasks a band of rows_per_task rows */
static inline OrtStatus* quantize_then_run(const OrtApi* api, OrtKernelContext* ctx, void (*quantize)(void*, size_t),
                                           void* rows, int64_t M, void (*task)(void*, size_t), int col_tasks,
                                           int64_t rows_per_task, void* job) {
  if (M > 4) TRY(api->KernelContext_ParallelFor(ctx, quantize, (size_t)M, 0, rows));
  else for (int64_t m = 0; m < M; m++) quantize(rows, (size_t)m);
  const size_t tasks = (size_t)col_tasks * (size_t)((M + rows_per_task - 1) / rows_per_task);
  return api->KernelContext_ParallelFor(ctx, task, tasks, 0, job);
}

/* callbacks every op of ours shares */
static inline void op_free(void* kernel) { free(kernel); }
static inline const char* op_cpu(const OrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
static inline int op_float(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return T_FLOAT; }
static inline int op_required(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return 0; }
static inline int op_cpu_memory(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return 0; }
#endif

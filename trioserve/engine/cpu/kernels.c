/* trioserve's native CPU kernels, the Python module: the 4-bit matmul, the
   8-bit vocabulary projection, the residual add with RMS norm, rope with the
   KV cache write and causal attention, the MLP's silu(gate) * up, and every
   layer of a forward pass in one call. Each computes a row from that row
   alone (kernels_arith.h says how, and why the bits do not depend on the
   batch).

   The arithmetic is compiled once per instruction-set path (kernels_avx512.c:
   AVX-512 with VNNI and BF16; kernels_avx2_vnni.c: AVX2 with AVX-VNNI;
   kernels_avx2.c: AVX2 with FMA and F16C; on
   ARM64 kernels_neon_dotprod.c and kernels_neon.c), all in one library; this file, built for the baseline of the architecture, picks
   the best path this CPU runs when the module loads (cpuid), and use() picks
   another. Every path gives the same bits (kernels.h).

   Built and loaded by trioserve/engine/cpu/native_build.py. Its functions
   take raw addresses: Python checks shapes, dtypes and contiguity before
   calling. */

#define PY_SSIZE_T_CLEAN
/* The stable ABI of CPython 3.11 and later: one library for every Python
   version from the project's oldest on (its file is _trioserve_cpu.abi3.so).
   A free-threaded CPython has no stable ABI (its objects' headers differ):
   there the library is built for that interpreter alone. */
#include <pyconfig.h>
#ifndef Py_GIL_DISABLED
#define Py_LIMITED_API 0x030B0000
#endif
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

/* The paths this build holds, best first, and whether this CPU runs each. */
typedef struct {
    const kernel_path *path;
    int (*runs)(void);
} candidate;

#if defined(__x86_64__)
static int runs_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
}

static int runs_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("fma");
}

#if KERNELS_HAVE_AVX2_VNNI
#include <cpuid.h>

/* AVX-VNNI: cpuid leaf 7, subleaf 1, EAX bit 4 (GCC's __builtin_cpu_supports
   knows it only since 11, clang's later), with AVX2's OS support checked by
   runs_avx2. */
static int runs_avx2_vnni(void) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!runs_avx2() || !__get_cpuid_count(7, 1, &a, &b, &c, &d)) return 0;
    return (a >> 4) & 1;
}
#endif

static const candidate candidates[] = {
    {&kernels_avx512, runs_avx512},
#if KERNELS_HAVE_AVX2_VNNI
    {&kernels_avx2_vnni, runs_avx2_vnni},
#endif
    {&kernels_avx2, runs_avx2},
};
#define CANDIDATES (sizeof(candidates) / sizeof(candidates[0]))
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif

static int runs_neon_dotprod(void) { return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0; }

static int runs_neon(void) { return 1; /* every ARM64 CPU */ }

static const candidate candidates[] = {
    {&kernels_neon_dotprod, runs_neon_dotprod},
    {&kernels_neon, runs_neon},
};
#define CANDIDATES (sizeof(candidates) / sizeof(candidates[0]))
#else
static const candidate candidates[1] = {{NULL, NULL}};
#define CANDIDATES 0
#endif

/* The path the functions below call (NULL: none runs here). */
static const kernel_path *active = NULL;

static const kernel_path *best(void) {
    for (size_t i = 0; i < CANDIDATES; i++)
        if (candidates[i].runs()) return candidates[i].path;
    return NULL;
}

/* Every function checks this first: a call with no path is an error, never
   an illegal instruction. */
static int have_path(void) {
    if (active == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no kernel path runs on this CPU");
        return 0;
    }
    return 1;
}

/* Reads `pointers` addresses, then numbers. An address may be None (NULL)
   only where bit i of `optional` says so; anything else is a ValueError. */
static int read_args_opt(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, int pointers,
                         void **ptr, long long *num, const char *usage, unsigned optional) {
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    for (int i = 0; i < pointers; i++) {
        ptr[i] = args[i] == Py_None ? NULL : PyLong_AsVoidPtr(args[i]);
        if (PyErr_Occurred()) return -1;
        if (ptr[i] == NULL && !(optional & (1u << i))) {
            PyErr_SetString(PyExc_ValueError, "a required buffer's address is None or 0");
            return -1;
        }
    }
    for (Py_ssize_t i = pointers; i < want; i++) {
        num[i - pointers] = PyLong_AsLongLong(args[i]);
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

static int read_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, int pointers,
                     void **ptr, long long *num, const char *usage) {
    return read_args_opt(args, nargs, want, pointers, ptr, num, usage, 0);
}

/* A thread count OpenMP can take. */
static int threads_ok(long long threads) {
    if (threads < 1 || threads > 4096) {
        PyErr_SetString(PyExc_ValueError, "threads must be in [1, 4096]");
        return 0;
    }
    return 1;
}

static PyObject *int8_mm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *ptr[4];
    long long dims[5];
    if (read_args(args, nargs, 9, 4, ptr, dims,
                  "int8_mm(x, q, scale, out, M, N, K, out_bf16, threads)"))
        return NULL;
    if (dims[0] < 1 || dims[1] < 1 || dims[2] < 16 || dims[2] % 16) {
        PyErr_SetString(PyExc_ValueError, "int8_mm: M, N >= 1, K a positive multiple of 16");
        return NULL;
    }
    if (!threads_ok(dims[4])) return NULL;
    if (!have_path()) return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = active->int8_matmul((const uint16_t *)ptr[0], (const int8_t *)ptr[1], (const uint16_t *)ptr[2],
                                 ptr[3], dims[3] != 0, dims[0], dims[1], dims[2], (int)dims[4]);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *ptr[7];
    long long num[8];
    if (nargs != 16) {
        PyErr_SetString(PyExc_TypeError,
                        "attention(qkv, cos, sin, cache, slots, pos, out, R, H, K, E, T, S, "
                        "rope_length, scale, threads)");
        return NULL;
    }
    if (read_args(args, 14, 14, 7, ptr, num, "")) return NULL;
    double scale = PyFloat_AsDouble(args[14]);
    long long threads = PyLong_AsLongLong(args[15]);
    if (PyErr_Occurred()) return NULL;
    attn_args a = {.qkv = ptr[0], .cos = ptr[1], .sin = ptr[2], .cache = ptr[3], .slots = ptr[4],
                   .pos = ptr[5], .out = ptr[6], .R = num[0], .H = num[1], .K = num[2],
                   .E = num[3], .T = num[4], .scale = (float)scale};
    long long S = num[5], rope_length = num[6];
    if (!threads_ok(threads)) return NULL;
    if (a.R < 1 || a.K < 1 || a.H < 1 || a.H % a.K || a.H / a.K > MAX_GROUP_HEADS || a.E < 32 || a.E % 32) {
        PyErr_SetString(PyExc_ValueError, "attention: R >= 1, H a multiple of K (at most MAX_GROUP_HEADS times), E a multiple of 32");
        return NULL;
    }
    for (int64_t r = 0; r < a.R; r++) {
        if (a.slots[r] < 0 || a.slots[r] >= S || a.pos[r] < 0 || a.pos[r] >= a.T || a.pos[r] >= rope_length) {
            PyErr_SetString(PyExc_ValueError, "attention: a row's slot or position is outside the cache");
            return NULL;
        }
    }
    if (!have_path()) return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = active->attention(&a, (int)threads);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *ptr[2];
    long long num[3];
    if (read_args(args, nargs, 5, 2, ptr, num, "silu_mul(gate_up, out, R, F, threads)")) return NULL;
    if (num[0] < 1 || num[1] < 16 || num[1] % 16 || !threads_ok(num[2])) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "silu_mul: R >= 1, F a positive multiple of 16");
        return NULL;
    }
    if (!have_path()) return NULL;
    Py_BEGIN_ALLOW_THREADS
    active->silu_mul((const uint16_t *)ptr[0], (uint16_t *)ptr[1], num[0], num[1], (int)num[2]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* forward_layers' arguments by name (kernels.h's FORWARD_ARGS). */
struct forward_args {
#define ARG_ADDR(name) void *name;
#define ARG_INT(name) long long name;
#define ARG_REAL(name) double name;
    FORWARD_ARGS(ARG_ADDR, ARG_INT, ARG_REAL)
#undef ARG_ADDR
#undef ARG_INT
#undef ARG_REAL
};

#define ARG_NAME(name) #name,
static const char *const forward_arg_names[] = {FORWARD_ARGS(ARG_NAME, ARG_NAME, ARG_NAME)};
#undef ARG_NAME
#define FORWARD_NARGS ((Py_ssize_t)(sizeof forward_arg_names / sizeof forward_arg_names[0]))

/* Reads forward_layers' arguments in FORWARD_ARGS' order: a None or 0
   address, or a number that is not one, is an error. */
static int read_forward_args(PyObject *const *args, Py_ssize_t nargs, struct forward_args *a) {
    if (nargs != FORWARD_NARGS) {
        PyErr_Format(PyExc_TypeError, "forward_layers takes %zd arguments (forward_args()), got %zd",
                     FORWARD_NARGS, nargs);
        return -1;
    }
    Py_ssize_t i = 0;
#define ARG_ADDR(name)                                                                      \
    a->name = args[i] == Py_None ? NULL : PyLong_AsVoidPtr(args[i]);                        \
    i++;                                                                                    \
    if (PyErr_Occurred()) return -1;                                                        \
    if (a->name == NULL) {                                                                  \
        PyErr_SetString(PyExc_ValueError, "forward_layers: " #name "'s address is None or 0"); \
        return -1;                                                                          \
    }
#define ARG_INT(name)                                                                       \
    a->name = PyLong_AsLongLong(args[i++]);                                                 \
    if (PyErr_Occurred()) return -1;
#define ARG_REAL(name)                                                                      \
    a->name = PyFloat_AsDouble(args[i++]);                                                  \
    if (PyErr_Occurred()) return -1;
    FORWARD_ARGS(ARG_ADDR, ARG_INT, ARG_REAL)
#undef ARG_ADDR
#undef ARG_INT
#undef ARG_REAL
    return 0;
}

static PyObject *forward_layers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    struct forward_args a;
    if (read_forward_args(args, nargs, &a)) return NULL;
    long long R = a.R, D = a.D, H = a.H, K = a.K, E = a.E, F = a.F;
    long long n_layers = a.n_layers, T = a.T, S = a.S, rope_length = a.rope_length, threads = a.threads;
    const int64_t *slots = a.slots, *pos = a.pos;
    if (!threads_ok(threads)) return NULL;
    if (R < 1 || D < 32 || D % 32 || K < 1 || H < 1 || H % K || H / K > MAX_GROUP_HEADS || E < 32 || E % 32 ||
        (H * E) % 32 || F < 32 || F % 32 || n_layers < 1) {
        PyErr_SetString(PyExc_ValueError, "forward_layers: shapes the kernels cannot run");
        return NULL;
    }
    for (int64_t r = 0; r < R; r++) {
        if (slots[r] < 0 || slots[r] >= S || pos[r] < 0 || pos[r] >= T || pos[r] >= rope_length) {
            PyErr_SetString(PyExc_ValueError, "forward_layers: a row's slot or position is outside the cache");
            return NULL;
        }
    }
    if (!have_path()) return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = active->layers((float *)a.x, R, D, H, K, E, F, n_layers, (const int64_t *)a.table,
                    (const int64_t *)a.caches, T, (const float *)a.cos, (const float *)a.sin, slots,
                    pos, (float)a.eps, (float)a.scale, (int)threads);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *add_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "add_rms_norm(x, y or None, w, out, M, D, eps, threads)");
        return NULL;
    }
    void *ptr[4];
    long long dims[2];
    if (read_args_opt(args, 6, 6, 4, ptr, dims, "", 1u << 1)) return NULL;
    double eps = PyFloat_AsDouble(args[6]);
    long long threads = PyLong_AsLongLong(args[7]);
    if (PyErr_Occurred()) return NULL;
    if (dims[0] < 1 || dims[1] < 16 || dims[1] % 16 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "add_rms_norm: M >= 1, D a positive multiple of 16");
        return NULL;
    }
    if (!threads_ok(threads)) return NULL;
    if (!have_path()) return NULL;
    Py_BEGIN_ALLOW_THREADS
    active->add_norm((float *)ptr[0], (const uint16_t *)ptr[1], (const float *)ptr[2], (uint16_t *)ptr[3],
             dims[0], dims[1], (float)eps, (int)threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *q4_mm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *ptr[5];
    long long dims[4];
    if (read_args(args, nargs, 9, 5, ptr, dims, "q4_mm(x, w, d, m, out, M, N, K, threads)"))
        return NULL;
    if (dims[0] < 1 || dims[1] < 1 || dims[2] < GROUP || dims[2] % GROUP || dims[3] < 1) {
        PyErr_SetString(PyExc_ValueError, "q4_mm: M, N >= 1, K a positive multiple of 32");
        return NULL;
    }
    if (!threads_ok(dims[3])) return NULL;
    if (!have_path()) return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = active->q4_matmul((const uint16_t *)ptr[0], (const uint8_t *)ptr[1], (const uint16_t *)ptr[2],
                    (const uint16_t *)ptr[3], (uint16_t *)ptr[4], dims[0], dims[1], dims[2],
                    (int)dims[3]);
    Py_END_ALLOW_THREADS
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *isa(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    if (active == NULL) Py_RETURN_NONE;
    return PyUnicode_FromString(active->name);
}

static PyObject *isas(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *names = PyList_New(0);
    if (!names) return NULL;
    for (size_t i = 0; i < CANDIDATES; i++) {
        if (!candidates[i].runs()) continue;
        PyObject *name = PyUnicode_FromString(candidates[i].path->name);
        if (!name || PyList_Append(names, name) < 0) {
            Py_XDECREF(name);
            Py_DECREF(names);
            return NULL;
        }
        Py_DECREF(name);
    }
    PyObject *result = PyList_AsTuple(names);
    Py_DECREF(names);
    return result;
}

static PyObject *use(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8AndSize(arg, NULL);
    if (!name) return NULL;
    for (size_t i = 0; i < CANDIDATES; i++) {
        if (strcmp(candidates[i].path->name, name) != 0) continue;
        if (!candidates[i].runs()) {
            PyErr_Format(PyExc_ValueError, "this CPU cannot run the %s kernels", name);
            return NULL;
        }
        active = candidates[i].path;
        Py_RETURN_NONE;
    }
    PyErr_Format(PyExc_ValueError, "no kernel path named %R", arg);
    return NULL;
}

static PyObject *max_group_heads(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(MAX_GROUP_HEADS);
}

static PyObject *names_tuple(const char *const *names, Py_ssize_t n) {
    PyObject *result = PyTuple_New(n);
    if (!result) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyUnicode_FromString(names[i]);
        if (!name) {
            Py_DECREF(result);
            return NULL;
        }
        if (PyTuple_SetItem(result, i, name) < 0) { /* steals name, even on failure */
            Py_DECREF(result);
            return NULL;
        }
    }
    return result;
}

static PyObject *layer_fields(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#define LAYER_NAME(name) #name,
    static const char *const names[] = {LAYER_FIELDS(LAYER_NAME)};
#undef LAYER_NAME
    return names_tuple(names, L_FIELDS);
}

static PyObject *forward_args(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return names_tuple(forward_arg_names, FORWARD_NARGS);
}

static PyMethodDef methods[] = {
    {"q4_mm", (PyCFunction)(void (*)(void))q4_mm, METH_FASTCALL,
     "q4_mm(x, w, d, m, out, M, N, K, threads): out = x @ W.T (addresses of contiguous buffers)"},
    {"int8_mm", (PyCFunction)(void (*)(void))int8_mm, METH_FASTCALL,
     "int8_mm(x, q, scale, out, M, N, K, out_bf16, threads): out = x @ (q * scale).T, q in "
     "blocks of 16 outputs (int8_layout.pack_int8)"},
    {"add_rms_norm", (PyCFunction)(void (*)(void))add_rms_norm, METH_FASTCALL,
     "add_rms_norm(x, y, w, out, M, D, eps, threads): x += y; out = rms_norm(x) * w"},
    {"attention", (PyCFunction)(void (*)(void))attention, METH_FASTCALL,
     "attention(...): rope, the KV cache write and causal attention of a forward pass's rows"},
    {"silu_mul", (PyCFunction)(void (*)(void))silu_mul, METH_FASTCALL,
     "silu_mul(gate_up, out, R, F, threads): out = silu(gate) * up"},
    {"forward_layers", (PyCFunction)(void (*)(void))forward_layers, METH_FASTCALL,
     "forward_layers(...): every layer of a forward pass on the residual stream, in place"},
    {"isa", isa, METH_NOARGS, "the instruction-set path the functions run (None: none runs here)"},
    {"isas", isas, METH_NOARGS, "the paths this CPU runs, best first"},
    {"use", use, METH_O, "use(name): run the named path (one of isas())"},
    {"max_group_heads", max_group_heads, METH_NOARGS,
     "the most query heads per KV head the attention kernel takes"},
    {"layer_fields", layer_fields, METH_NOARGS,
     "the names of a layer table row's columns (forward_layers), in order"},
    {"forward_args", forward_args, METH_NOARGS, "the names of forward_layers' arguments, in order"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_trioserve_cpu", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__trioserve_cpu(void) {
    active = best();
    return PyModule_Create(&module);
}

/*
 * Whole-block copies between vLLM's CPU paged KV cache and a flat chunk buffer, in one call,
 * optionally hashing the chunk (XXH3-64, xxh3.h) in the same pass.
 *
 * Why compiled: a chunk of the tiny model is 8 blocks of 128 KiB (1 MiB). Copying it one numpy
 * row at a time cost ~5-8 us of Python (argument checks, a view and a dispatch per row) on top of
 * a ~23 us memcpy, 0.74x memcpy in all; this loop costs a call. cpu_blocks.py checks everything
 * it passes here except the block ids' range, which is checked below before any byte moves; the
 * addresses come from tensors that CpuKVCache keeps alive. The GIL is released while bytes move,
 * so the connector's NIXL thread runs during a copy.
 *
 * Why hash here: the checksum a chunk travels with used to be a pass of its own over the
 * chunk on each side, a third of a push's throughput; hashed while it is copied, each stripe is
 * hashed from the registers that copy it, and the bytes are read from memory once.
 *
 * copy_blocks(chunk_addr, layer_addrs, layer_strides, num_blocks, block_nbytes, block_ids,
 *             to_chunk, skip, hashed) -> int | None
 *   chunk_addr     address of the chunk: len(layer_addrs) * (skip + len(block_ids)) blocks,
 *                  ordered [layer][block][bytes of the block]
 *   layer_addrs    tuple of each layer's address (its block 0)
 *   layer_strides  tuple of each layer's bytes from one block to the next
 *   num_blocks     blocks in every layer; an id outside [0, num_blocks) raises ValueError
 *   block_nbytes   bytes of one block of one layer (contiguous)
 *   block_ids      list of int
 *   to_chunk       true: cache -> chunk (gather); false: chunk -> cache (scatter)
 *   skip           scatter only: the first `skip` blocks of each layer of the chunk are not
 *                  copied (decode's own cache holds them), only hashed; 0 for a gather
 *   hashed         true: return the XXH3-64 of the whole chunk's bytes; false: None
 *
 * xxh3_64(addr, nbytes) -> int: XXH3-64 of nbytes at addr, the same hash without a copy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "xxh3.h"

static int as_addresses(PyObject *tuple, Py_ssize_t count, const char *name, Py_ssize_t *out) {
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != count) {
        PyErr_Format(PyExc_TypeError, "%s must be a tuple of %zd ints", name, count);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        out[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(tuple, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            return -1;
        }
    }
    return 0;
}

/* Copy (and hash) the chunk; called with the GIL released. */
static uint64_t copy_loop(char *chunk, const Py_ssize_t *addrs, const Py_ssize_t *strides,
                          Py_ssize_t num_layers, const Py_ssize_t *ids, Py_ssize_t count,
                          Py_ssize_t skip, size_t block_nbytes, int to_chunk, int hashed) {
    xxh3_stream h;
    size_t per_layer = (size_t)(skip + count), offset = 0;
    if (hashed) {
        xxh3_begin(&h, (const uint8_t *)chunk, (size_t)num_layers * per_layer * block_nbytes);
    }
    for (Py_ssize_t layer = 0; layer < num_layers; layer++) {
        char *base = (char *)addrs[layer];
        for (Py_ssize_t j = 0; j < skip + count; j++, offset += block_nbytes) {
            if (j < skip) {
                if (hashed) {
                    xxh3_seen(&h, offset + block_nbytes);
                }
                continue;
            }
            uint8_t *block = (uint8_t *)base + ids[j - skip] * strides[layer];
            uint8_t *dst = to_chunk ? (uint8_t *)chunk + offset : block;
            const uint8_t *src = to_chunk ? block : (const uint8_t *)chunk + offset;
            if (hashed) {
                xxh3_copy(&h, dst, src, offset, block_nbytes);
            } else {
                memcpy(dst, src, block_nbytes);
            }
        }
    }
    return hashed ? xxh3_end(&h) : 0;
}

static PyObject *copy_blocks(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "copy_blocks takes 9 arguments, got %zd", nargs);
        return NULL;
    }
    char *chunk = (char *)PyLong_AsVoidPtr(args[0]);
    Py_ssize_t num_blocks = PyLong_AsSsize_t(args[3]);
    Py_ssize_t block_nbytes = PyLong_AsSsize_t(args[4]);
    int to_chunk = PyObject_IsTrue(args[6]);
    Py_ssize_t skip = PyLong_AsSsize_t(args[7]);
    int hashed = PyObject_IsTrue(args[8]);
    if (PyErr_Occurred() || to_chunk < 0 || hashed < 0) {
        return NULL;
    }
    if (skip < 0 || (to_chunk && skip != 0)) {
        PyErr_Format(PyExc_ValueError, "skip must be 0 for a gather and >= 0, got %zd", skip);
        return NULL;
    }
    if (!PyTuple_Check(args[1]) || !PyList_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "layer_addrs must be a tuple and block_ids a list");
        return NULL;
    }
    Py_ssize_t num_layers = PyTuple_GET_SIZE(args[1]);
    Py_ssize_t count = PyList_GET_SIZE(args[5]);

    /* one allocation: layer addresses, layer strides, block ids */
    Py_ssize_t *scratch = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(2 * num_layers + count + 1));
    if (scratch == NULL) {
        return PyErr_NoMemory();
    }
    Py_ssize_t *addrs = scratch, *strides = scratch + num_layers, *ids = strides + num_layers;
    if (as_addresses(args[1], num_layers, "layer_addrs", addrs) < 0 ||
        as_addresses(args[2], num_layers, "layer_strides", strides) < 0) {
        PyMem_Free(scratch);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        ids[i] = PyLong_AsSsize_t(PyList_GET_ITEM(args[5], i));
        if (ids[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(scratch);
            return NULL;
        }
        if (ids[i] < 0 || ids[i] >= num_blocks) {
            PyErr_Format(PyExc_ValueError,
                         "block id %zd (block_ids[%zd]) falls outside the cache's %zd blocks",
                         ids[i], i, num_blocks);
            PyMem_Free(scratch);
            return NULL;
        }
    }

    uint64_t hash;
    Py_BEGIN_ALLOW_THREADS
    hash = copy_loop(chunk, addrs, strides, num_layers, ids, count, skip, (size_t)block_nbytes,
                     to_chunk, hashed);
    Py_END_ALLOW_THREADS

    PyMem_Free(scratch);
    if (!hashed) {
        Py_RETURN_NONE;
    }
    return PyLong_FromUnsignedLongLong(hash);
}

static PyObject *xxh3_64(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "xxh3_64 takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    const uint8_t *data = (const uint8_t *)PyLong_AsVoidPtr(args[0]);
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (nbytes < 0) {
        PyErr_Format(PyExc_ValueError, "nbytes must be >= 0, got %zd", nbytes);
        return NULL;
    }
    uint64_t hash;
    Py_BEGIN_ALLOW_THREADS
    xxh3_stream h;
    xxh3_begin(&h, data, (size_t)nbytes);
    hash = xxh3_end(&h);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(hash);
}

static PyMethodDef methods[] = {
    {"copy_blocks", (PyCFunction)(void (*)(void))copy_blocks, METH_FASTCALL,
     "Copy whole KV blocks between a paged cache and a chunk (see the file's header)."},
    {"xxh3_64", (PyCFunction)(void (*)(void))xxh3_64, METH_FASTCALL,
     "XXH3-64 of nbytes at an address (see the file's header)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_cpu_block_copy",
    .m_doc = "Whole-block copies between vLLM's CPU paged KV cache and a chunk buffer.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__cpu_block_copy(void) { return PyModule_Create(&module_def); }

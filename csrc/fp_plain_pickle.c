/* fastpersist._plain_pickle: fastpersist/plain_pickle.py's writer in C.
 *
 * The same pickle, opcode for opcode (the Python module's note says why each
 * is what torch.save writes; tests/test_plain_pickle.py runs every case
 * through both and compares them with torch's own bytes), without the
 * interpreter's per-opcode work: what is left per tensor is the calls into
 * torch that ask for its storage, sizes and strides.
 *
 * dump(obj, ctx) -> (pickle bytes, {key: storage}, depth); raises Unsupported
 * where torch's pickling must run instead (plain_pickle.dump then returns
 * None). depth: how many containers deep the object goes, for the caller to
 * ask headroom(n) whether torch's pickler, which spends up to two recursion
 * levels a container, would have room for it (plain_pickle.dump).
 * ctx is a tuple of the torch objects the writer compares against, built by
 * plain_pickle._c_context(). Limited API (abi3): one build serves every
 * Python the wheel supports.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum {
    C_TENSOR, C_PARAMETER, C_ORDERED_DICT, C_STRIDED, C_STORAGE_STR, C_CPU_STR, C_V3_DTYPES, C_STORAGE_CLASSES,
    C_REBUILD_V2, C_REBUILD_V3, C_REBUILD_PARAMETER, C_GET_METADATA, C_GET_OBJ_STATE, C_LATIN1, C_CODECS_ENCODE,
    C_BYTES_TYPE, C_DTYPE_TYPE, C_DEVICE_TYPE, C_SIZE_TYPE, C_UNTYPED_STORAGE, C_ENCODE_LONG, C_GLOBAL_NAMES,
    C_UINT8, C_COUNT
};

static PyObject *Unsupported;
/* attribute and method names, interned once */
static PyObject *s_layout, *s_dict, *s_hooks, *s_is_quantized, *s_is_nested, *s_device, *s_type, *s_index,
    *s_requires_grad, *s_grad_fn, *s_dtype, *s_untyped_storage, *s_nbytes, *s_element_size, *s_data_ptr, *s_cdata,
    *s_storage_offset, *s_size, *s_stride, *s_data, *s_items;

/* -- memo: object address -> index (objects kept alive by the caller's graph or w->keep) -- */
typedef struct {
    void *key;
    Py_ssize_t value;
} Slot;

typedef struct {
    char *buf;
    size_t len, cap;
    Slot *table;
    size_t mask, used;
    Py_ssize_t next;     /* next memo index */
    PyObject *keep;      /* list: objects of ours whose addresses are in the memo */
    PyObject *storages;  /* dict key -> storage, in key order */
    PyObject *keys;      /* dict storage._cdata -> memo index of its key string */
    PyObject *dtypes;    /* dict data_ptr -> dtype */
    PyObject **ctx;
    long depth, max_depth; /* containers being written, and the most at once */
} W;

static size_t hash_ptr(void *p)
{
    uintptr_t x = (uintptr_t)p;
    x ^= x >> 17;
    x *= 0x9E3779B97F4A7C15ull;
    return (size_t)(x ^ (x >> 29));
}

static Py_ssize_t memo_get(W *w, void *key)
{
    size_t i = hash_ptr(key) & w->mask;
    while (w->table[i].key) {
        if (w->table[i].key == key)
            return w->table[i].value;
        i = (i + 1) & w->mask;
    }
    return -1;
}

static int memo_set(W *w, void *key, Py_ssize_t value)
{
    size_t i;
    if (2 * (w->used + 1) > w->mask + 1) {
        size_t n = 2 * (w->mask + 1), j;
        Slot *old = w->table, *table = PyMem_Calloc(n, sizeof(Slot));
        if (!table) {
            PyErr_NoMemory();
            return -1;
        }
        w->table = table;
        for (j = 0; j <= w->mask; j++) {
            if (old[j].key) {
                size_t k = hash_ptr(old[j].key) & (n - 1);
                while (table[k].key)
                    k = (k + 1) & (n - 1);
                table[k] = old[j];
            }
        }
        w->mask = n - 1;
        PyMem_Free(old);
    }
    i = hash_ptr(key) & w->mask;
    while (w->table[i].key && w->table[i].key != key)
        i = (i + 1) & w->mask;
    if (!w->table[i].key)
        w->used++;
    w->table[i].key = key;
    w->table[i].value = value;
    return 0;
}

/* -- output -- */
static int out(W *w, const void *data, size_t n)
{
    if (w->len + n > w->cap) {
        size_t cap = w->cap * 2 > w->len + n ? w->cap * 2 : w->len + n + 4096;
        char *p = PyMem_Realloc(w->buf, cap);
        if (!p) {
            PyErr_NoMemory();
            return -1;
        }
        w->buf = p;
        w->cap = cap;
    }
    memcpy(w->buf + w->len, data, n);
    w->len += n;
    return 0;
}

static int op(W *w, char c)
{
    return out(w, &c, 1);
}

static int op_u32(W *w, char c, uint32_t v)
{
    unsigned char b[5] = {(unsigned char)c, v & 0xff, (v >> 8) & 0xff, (v >> 16) & 0xff, (v >> 24) & 0xff};
    return out(w, b, 5);
}

static int put(W *w)
{
    Py_ssize_t i = w->next++;
    if (i < 256) {
        unsigned char b[2] = {'q', (unsigned char)i};
        return out(w, b, 2);
    }
    return op_u32(w, 'r', (uint32_t)i);
}

static int memoize(W *w, PyObject *obj)
{
    if (memo_set(w, obj, w->next) < 0)
        return -1;
    return put(w);
}

static int get(W *w, Py_ssize_t i)
{
    if (i < 256) {
        unsigned char b[2] = {'h', (unsigned char)i};
        return out(w, b, 2);
    }
    return op_u32(w, 'j', (uint32_t)i);
}

static int unsupported(const char *why)
{
    PyErr_SetString(Unsupported, why);
    return -1;
}

static int save(W *w, PyObject *obj);

static int save_int_value(W *w, long v)
{
    if (v >= 0 && v < 256) {
        unsigned char b[2] = {'K', (unsigned char)v};
        return out(w, b, 2);
    }
    if (v >= 0 && v < 65536) {
        unsigned char b[3] = {'M', v & 0xff, (v >> 8) & 0xff};
        return out(w, b, 3);
    }
    return op_u32(w, 'J', (uint32_t)(int32_t)v);
}

static int save_long(W *w, PyObject *obj)
{
    int overflow = 0;
    long v = PyLong_AsLongAndOverflow(obj, &overflow);
    PyObject *data;
    int rc;
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (!overflow && v >= -0x80000000L && v <= 0x7fffffffL)
        return save_int_value(w, v);
    /* LONG1 / LONG4 with pickle's encoding, from plain_pickle._encode_long */
    data = PyObject_CallFunctionObjArgs(w->ctx[C_ENCODE_LONG], obj, NULL);
    if (!data)
        return -1;
    {
        Py_ssize_t n = PyBytes_Size(data);
        if (n < 256) {
            unsigned char b[2] = {0x8a, (unsigned char)n};
            rc = out(w, b, 2);
        } else {
            rc = op_u32(w, (char)0x8b, (uint32_t)n);
        }
        if (rc == 0)
            rc = out(w, PyBytes_AsString(data), (size_t)n);
    }
    Py_DECREF(data);
    return rc;
}

static int save_float(W *w, PyObject *obj)
{
    double d = PyFloat_AsDouble(obj);
    unsigned char b[9];
    uint64_t bits;
    int i;
    if (d == -1.0 && PyErr_Occurred())
        return -1;
    memcpy(&bits, &d, 8);
    b[0] = 'G';
    for (i = 0; i < 8; i++)
        b[1 + i] = (unsigned char)(bits >> (56 - 8 * i));
    return out(w, b, 9);
}

static int write_str(W *w, PyObject *obj)
{
    PyObject *data = PyUnicode_AsEncodedString(obj, "utf-8", "surrogatepass");
    int rc;
    if (!data)
        return -1;
    rc = op_u32(w, 'X', (uint32_t)PyBytes_Size(data));
    if (rc == 0)
        rc = out(w, PyBytes_AsString(data), (size_t)PyBytes_Size(data));
    Py_DECREF(data);
    return rc;
}

/* GLOBAL "module\nname\n" of obj (names from ctx[C_GLOBAL_NAMES]: obj -> bytes), or its BINGET */
static int global(W *w, PyObject *obj)
{
    Py_ssize_t i = memo_get(w, obj);
    PyObject *name;
    if (i >= 0)
        return get(w, i);
    name = PyDict_GetItem(w->ctx[C_GLOBAL_NAMES], obj); /* borrowed */
    if (!name)
        return unsupported("a global plain_pickle cannot name");
    if (out(w, PyBytes_AsString(name), (size_t)PyBytes_Size(name)) < 0)
        return -1;
    return memoize(w, obj);
}

static int keep(W *w, PyObject *obj)
{
    return PyList_Append(w->keep, obj);
}

static int save_tuple_items(W *w, PyObject *obj, Py_ssize_t n)
{
    Py_ssize_t i;
    for (i = 0; i < n; i++)
        if (save(w, PyTuple_GetItem(obj, i)) < 0)
            return -1;
    return 0;
}

static int save_tuple(W *w, PyObject *obj)
{
    Py_ssize_t n = PyTuple_Size(obj);
    static const char ends[] = {(char)0x85, (char)0x86, (char)0x87};
    if (n == 0)
        return op(w, ')');
    if (n > 3 && op(w, '(') < 0)
        return -1;
    if (save_tuple_items(w, obj, n) < 0)
        return -1;
    if (memo_get(w, obj) >= 0)
        return unsupported("a recursive tuple");
    if (op(w, n > 3 ? 't' : ends[n - 1]) < 0)
        return -1;
    return memoize(w, obj);
}

static int save_pair(W *w, PyObject *key, PyObject *value)
{
    int rc;
    Py_INCREF(key);
    Py_INCREF(value);
    rc = save(w, key) < 0 || save(w, value) < 0 ? -1 : 0;
    Py_DECREF(key);
    Py_DECREF(value);
    return rc;
}

/* An exact dict's items, walked in place as the C pickler walks them: one
 * item with SETITEM, else batches of 1000 (an empty last batch where the
 * size is a multiple of 1000). */
static int save_dict(W *w, PyObject *obj)
{
    Py_ssize_t n, pos = 0, i;
    PyObject *key, *value;
    if (op(w, '}') < 0 || memoize(w, obj) < 0)
        return -1;
    n = PyDict_Size(obj);
    if (n == 0)
        return 0;
    if (n == 1) {
        PyDict_Next(obj, &pos, &key, &value);
        return save_pair(w, key, value) < 0 ? -1 : op(w, 's');
    }
    do {
        if (op(w, '(') < 0)
            return -1;
        for (i = 0; i < 1000 && PyDict_Next(obj, &pos, &key, &value); i++)
            if (save_pair(w, key, value) < 0)
                return -1;
        if (op(w, 'u') < 0)
            return -1;
        if (PyDict_Size(obj) != n)
            return unsupported("a dict changed size while pickled");
    } while (i == 1000);
    return 0;
}

/* An item (key, value) from an items iterator: saved, and released */
static int save_item(W *w, PyObject *item)
{
    int rc = save_pair(w, PyTuple_GetItem(item, 0), PyTuple_GetItem(item, 1));
    Py_DECREF(item);
    return rc;
}

/* An OrderedDict's items from its iterator, as the C pickler batches them:
 * a trailing single item with SETITEM, other batches of up to 1000 */
static int save_items(W *w, PyObject *iterator)
{
    for (;;) {
        PyObject *first = PyIter_Next(iterator), *item;
        Py_ssize_t n = 1;
        if (!first)
            return PyErr_Occurred() ? -1 : 0;
        item = PyIter_Next(iterator);
        if (!item) {
            if (PyErr_Occurred()) {
                Py_DECREF(first);
                return -1;
            }
            return save_item(w, first) < 0 ? -1 : op(w, 's');
        }
        if (op(w, '(') < 0 || save_item(w, first) < 0) {
            Py_DECREF(item);
            return -1;
        }
        while (item) {
            if (save_item(w, item) < 0)
                return -1;
            if (++n == 1000)
                break;
            item = PyIter_Next(iterator);
        }
        if (PyErr_Occurred() || op(w, 'u') < 0)
            return -1;
        if (n < 1000)
            return 0;
    }
}

static int save_list(W *w, PyObject *obj)
{
    Py_ssize_t total = 0, i;
    if (op(w, ']') < 0 || memoize(w, obj) < 0)
        return -1;
    if (PyList_Size(obj) == 0)
        return 0;
    if (PyList_Size(obj) == 1) {
        PyObject *item = PyList_GetItem(obj, 0);
        int rc;
        Py_INCREF(item);
        rc = save(w, item);
        Py_DECREF(item);
        return rc < 0 ? -1 : op(w, 'a');
    }
    while (total < PyList_Size(obj)) {
        Py_ssize_t stop = total + 1000 < PyList_Size(obj) ? total + 1000 : PyList_Size(obj);
        if (op(w, '(') < 0)
            return -1;
        for (i = total; i < stop; i++) {
            PyObject *item = PyList_GetItem(obj, i);
            int rc;
            Py_INCREF(item);
            rc = save(w, item);
            Py_DECREF(item);
            if (rc < 0)
                return -1;
        }
        if (op(w, 'e') < 0)
            return -1;
        total = stop;
    }
    return 0;
}

static int empty_ordered_dict(W *w)
{
    if (global(w, w->ctx[C_ORDERED_DICT]) < 0 || out(w, ")R", 2) < 0)
        return -1;
    return put(w);
}

static int save_ordered_dict(W *w, PyObject *obj)
{
    /* OrderedDict.__reduce__: (OrderedDict, (), __dict__ or None, None, iter(items)) */
    PyObject *state = PyObject_GetAttr(obj, s_dict), *items_view = NULL, *iterator = NULL;
    int rc = -1;
    if (!state)
        return -1;
    if (global(w, w->ctx[C_ORDERED_DICT]) < 0 || out(w, ")R", 2) < 0 || memoize(w, obj) < 0)
        goto done;
    items_view = PyObject_CallMethodObjArgs(obj, s_items, NULL);
    if (!items_view || !(iterator = PyObject_GetIter(items_view)) || save_items(w, iterator) < 0)
        goto done;
    if (PyDict_Size(state) > 0 && (save(w, state) < 0 || op(w, 'b') < 0))
        goto done;
    rc = 0;
done:
    Py_DECREF(state);
    Py_XDECREF(items_view);
    Py_XDECREF(iterator);
    return rc;
}

static int save_bytes(W *w, PyObject *obj)
{
    if (PyBytes_Size(obj) == 0) {
        if (global(w, w->ctx[C_BYTES_TYPE]) < 0 || out(w, ")R", 2) < 0)
            return -1;
    } else {
        PyObject *text;
        int rc;
        if (w->ctx[C_LATIN1] == Py_None)
            return unsupported("bytes");
        if (global(w, w->ctx[C_CODECS_ENCODE]) < 0)
            return -1;
        text = PyUnicode_DecodeLatin1(PyBytes_AsString(obj), PyBytes_Size(obj), NULL);
        if (!text)
            return -1;
        /* a one-character text is CPython's cached string, maybe already in the memo: save() looks */
        rc = keep(w, text);
        if (rc == 0)
            rc = save(w, text);
        Py_DECREF(text);
        if (rc < 0 || save(w, w->ctx[C_LATIN1]) < 0 || op(w, (char)0x86) < 0 || put(w) < 0 || op(w, 'R') < 0)
            return -1;
    }
    return memoize(w, obj);
}

/* torch.device or torch.Size: (cls, args) from __reduce_ex__(2) */
static int save_reduced(W *w, PyObject *obj, PyObject *cls)
{
    PyObject *reduced = PyObject_CallMethod(obj, "__reduce_ex__", "i", 2), *func, *args;
    int rc = -1;
    if (!reduced)
        return -1;
    if (keep(w, reduced) < 0)
        goto done;
    if (!PyTuple_Check(reduced) || PyTuple_Size(reduced) != 2) {
        unsupported("an unexpected reduction");
        goto done;
    }
    func = PyTuple_GetItem(reduced, 0);
    args = PyTuple_GetItem(reduced, 1);
    if (func != cls || !PyTuple_Check(args)) {
        unsupported("an unexpected reduction");
        goto done;
    }
    if (global(w, cls) < 0 || save_tuple(w, args) < 0 || op(w, 'R') < 0)
        goto done;
    rc = memoize(w, obj);
done:
    Py_DECREF(reduced);
    return rc;
}

static int truthy_attr(PyObject *obj, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    int t;
    if (!v)
        return -1;
    t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

static int save_sizes(W *w, PyObject *values)
{
    Py_ssize_t n = PyTuple_Size(values), i;
    static const char ends[] = {(char)0x85, (char)0x86, (char)0x87};
    if (n < 0)
        return -1;
    if (n == 0)
        return op(w, ')');
    if (n > 3 && op(w, '(') < 0)
        return -1;
    for (i = 0; i < n; i++) {
        long v = PyLong_AsLong(PyTuple_GetItem(values, i));
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (v < -0x80000000L || v > 0x7fffffffL)
            return unsupported("a size beyond 32 bits");
        if (save_int_value(w, v) < 0)
            return -1;
    }
    if (op(w, n > 3 ? 't' : ends[n - 1]) < 0)
        return -1;
    return put(w);
}

static PyObject *call0(PyObject *obj, PyObject *name)
{
    return PyObject_CallMethodObjArgs(obj, name, NULL);
}

static int save_tensor(W *w, PyObject *obj)
{
    PyObject **ctx = w->ctx;
    PyObject *layout = NULL, *device = NULL, *dtype = NULL, *storage = NULL, *meta = NULL, *location = NULL;
    PyObject *tmp = NULL, *size = NULL, *stride = NULL, *storage_class, *cdata = NULL, *known;
    long numel, nbytes;
    int requires_grad, v3, rc = -1, t;

    layout = PyObject_GetAttr(obj, s_layout);
    if (!layout)
        goto done;
    if (layout != ctx[C_STRIDED]) {
        unsupported("a tensor torch pickles another way");
        goto done;
    }
    tmp = PyObject_GetAttr(obj, s_dict);
    if (!tmp)
        goto done;
    t = PyObject_IsTrue(tmp);
    Py_CLEAR(tmp);
    if (t) {
        if (t > 0)
            unsupported("a tensor with Python state");
        goto done;
    }
    if ((t = truthy_attr(obj, s_hooks)) != 0 || (t = truthy_attr(obj, s_is_quantized)) != 0 ||
        (t = truthy_attr(obj, s_is_nested)) != 0) {
        if (t > 0)
            unsupported("a tensor torch pickles another way");
        goto done;
    }
    device = PyObject_GetAttr(obj, s_device);
    if (!device)
        goto done;
    tmp = PyObject_GetAttr(device, s_type);
    if (!tmp)
        goto done;
    if (PyUnicode_CompareWithASCIIString(tmp, "cpu") == 0) {
        location = NULL;
    } else if (PyUnicode_CompareWithASCIIString(tmp, "cuda") == 0) {
        PyObject *index = PyObject_GetAttr(device, s_index);
        if (!index)
            goto done;
        location = PyUnicode_FromFormat("cuda:%S", index); /* torch's tag: a fresh string per storage */
        Py_DECREF(index);
        if (!location)
            goto done;
    } else {
        unsupported("a tensor on another device");
        goto done;
    }
    Py_CLEAR(tmp);
    requires_grad = truthy_attr(obj, s_requires_grad);
    if (requires_grad < 0)
        goto done;
    if (requires_grad) {
        tmp = PyObject_GetAttr(obj, s_grad_fn);
        if (!tmp)
            goto done;
        if (tmp != Py_None) {
            unsupported("a non-leaf tensor");
            goto done;
        }
        Py_CLEAR(tmp);
    }
    meta = PyObject_CallFunctionObjArgs(ctx[C_GET_METADATA], obj, NULL);
    if (!meta)
        goto done;
    if ((t = PyObject_IsTrue(meta)) != 0) {
        if (t > 0)
            unsupported("a tensor with conj/neg bits");
        goto done;
    }
    dtype = PyObject_GetAttr(obj, s_dtype);
    if (!dtype)
        goto done;
    storage = call0(obj, s_untyped_storage);
    if (!storage)
        goto done;
    tmp = call0(storage, s_nbytes);
    if (!tmp)
        goto done;
    nbytes = PyLong_AsLong(tmp);
    Py_CLEAR(tmp);
    if (nbytes == -1 && PyErr_Occurred())
        goto done;
    v3 = PySet_Contains(ctx[C_V3_DTYPES], dtype);
    if (v3 < 0)
        goto done;
    if (v3) {
        if (global(w, ctx[C_REBUILD_V3]) < 0)
            goto done;
        storage_class = ctx[C_UNTYPED_STORAGE];
        numel = nbytes;
    } else {
        long element;
        if (global(w, ctx[C_REBUILD_V2]) < 0)
            goto done;
        storage_class = PyDict_GetItem(ctx[C_STORAGE_CLASSES], dtype); /* borrowed */
        if (!storage_class) {
            unsupported("a tensor of a dtype with no storage class");
            goto done;
        }
        tmp = call0(obj, s_element_size);
        if (!tmp)
            goto done;
        element = PyLong_AsLong(tmp);
        Py_CLEAR(tmp);
        if (element <= 0) {
            if (!PyErr_Occurred())
                unsupported("an element size of 0");
            goto done;
        }
        numel = nbytes / element;
    }
    if (out(w, "((", 2) < 0 || save(w, ctx[C_STORAGE_STR]) < 0 || global(w, storage_class) < 0)
        goto done;
    tmp = call0(storage, s_data_ptr);
    if (!tmp)
        goto done;
    if (PyObject_IsTrue(tmp)) {
        /* torch refuses two dtypes over one memory: its error, from its own pickling */
        PyObject *storage_dtype = v3 ? ctx[C_UINT8] : dtype, *seen = PyDict_GetItem(w->dtypes, tmp); /* borrowed */
        if (!seen) {
            if (PyDict_SetItem(w->dtypes, tmp, storage_dtype) < 0)
                goto done;
        } else if (seen != storage_dtype) {
            unsupported("two dtypes over one memory (torch refuses it)");
            goto done;
        }
    }
    Py_CLEAR(tmp);
    cdata = PyObject_GetAttr(storage, s_cdata);
    if (!cdata)
        goto done;
    known = PyDict_GetItem(w->keys, cdata); /* borrowed */
    if (!known) {
        PyObject *key = PyUnicode_FromFormat("%zd", PyDict_Size(w->keys)), *index;
        if (!key)
            goto done;
        index = PyLong_FromSsize_t(w->next);
        if (!index || PyDict_SetItem(w->storages, key, storage) < 0 || PyDict_SetItem(w->keys, cdata, index) < 0 ||
            write_str(w, key) < 0 || put(w) < 0) {
            Py_DECREF(key);
            Py_XDECREF(index);
            goto done;
        }
        Py_DECREF(key);
        Py_DECREF(index);
    } else if (get(w, PyLong_AsSsize_t(known)) < 0) {
        goto done;
    }
    if (location) {
        if (write_str(w, location) < 0 || put(w) < 0)
            goto done;
    } else if (save(w, ctx[C_CPU_STR]) < 0) {
        goto done;
    }
    if (numel > 0x7fffffffL) {
        PyObject *n = PyLong_FromLong(numel);
        int r = n ? save_long(w, n) : -1;
        Py_XDECREF(n);
        if (r < 0)
            goto done;
    } else if (save_int_value(w, numel) < 0) {
        goto done;
    }
    if (op(w, 't') < 0 || put(w) < 0 || op(w, 'Q') < 0)
        goto done;
    tmp = call0(obj, s_storage_offset);
    if (!tmp || save_long(w, tmp) < 0)
        goto done;
    Py_CLEAR(tmp);
    size = call0(obj, s_size);
    if (!size)
        goto done;
    stride = call0(obj, s_stride);
    if (!stride)
        goto done;
    if (save_sizes(w, size) < 0 || save_sizes(w, stride) < 0)
        goto done;
    if (op(w, requires_grad ? (char)0x88 : (char)0x89) < 0 || empty_ordered_dict(w) < 0)
        goto done;
    if (v3 && save(w, dtype) < 0)
        goto done;
    if (op(w, 't') < 0 || put(w) < 0 || op(w, 'R') < 0)
        goto done;
    rc = memoize(w, obj);
done:
    Py_XDECREF(layout);
    Py_XDECREF(device);
    Py_XDECREF(dtype);
    Py_XDECREF(storage);
    Py_XDECREF(meta);
    Py_XDECREF(location);
    Py_XDECREF(tmp);
    Py_XDECREF(size);
    Py_XDECREF(stride);
    Py_XDECREF(cdata);
    return rc;
}

static int save_parameter(W *w, PyObject *obj)
{
    PyObject *state = PyObject_CallFunctionObjArgs(w->ctx[C_GET_OBJ_STATE], obj, NULL), *data = NULL;
    int t, requires_grad, rc = -1;
    if (!state)
        return -1;
    t = PyObject_IsTrue(state);
    Py_DECREF(state);
    if (t) {
        return t > 0 ? unsupported("a Parameter with Python state") : -1;
    }
    if (global(w, w->ctx[C_REBUILD_PARAMETER]) < 0)
        return -1;
    data = PyObject_GetAttr(obj, s_data);
    if (!data)
        return -1;
    if (keep(w, data) < 0 || save(w, data) < 0)
        goto done;
    requires_grad = truthy_attr(obj, s_requires_grad);
    if (requires_grad < 0 || op(w, requires_grad ? (char)0x88 : (char)0x89) < 0 || empty_ordered_dict(w) < 0)
        goto done;
    if (op(w, (char)0x87) < 0 || put(w) < 0 || op(w, 'R') < 0)
        goto done;
    rc = memoize(w, obj);
done:
    Py_DECREF(data);
    return rc;
}

static int save(W *w, PyObject *obj)
{
    PyObject **ctx = w->ctx;
    PyTypeObject *t = Py_TYPE(obj);
    Py_ssize_t i;
    if (obj == Py_None)
        return op(w, 'N');
    if (obj == Py_True)
        return op(w, (char)0x88);
    if (obj == Py_False)
        return op(w, (char)0x89);
    if (t == &PyLong_Type)
        return save_long(w, obj);
    if (t == &PyFloat_Type)
        return save_float(w, obj);
    i = memo_get(w, obj);
    if (i >= 0)
        return get(w, i);
    if (t == &PyUnicode_Type)
        return write_str(w, obj) < 0 ? -1 : memoize(w, obj);
    if ((PyObject *)t == ctx[C_TENSOR])
        return save_tensor(w, obj);
    if (t == &PyDict_Type || t == &PyList_Type || t == &PyTuple_Type || (PyObject *)t == ctx[C_ORDERED_DICT] ||
        (PyObject *)t == ctx[C_PARAMETER]) {
        int rc;
        if (Py_EnterRecursiveCall(" in plain_pickle"))
            return -1; /* RecursionError: torch's pickling decides */
        if (++w->depth > w->max_depth)
            w->max_depth = w->depth;
        rc = t == &PyDict_Type ? save_dict(w, obj)
           : t == &PyList_Type ? save_list(w, obj)
           : t == &PyTuple_Type ? save_tuple(w, obj)
           : (PyObject *)t == ctx[C_ORDERED_DICT] ? save_ordered_dict(w, obj)
           : save_parameter(w, obj);
        w->depth--;
        Py_LeaveRecursiveCall();
        return rc;
    }
    if (t == &PyBytes_Type)
        return save_bytes(w, obj);
    if ((PyObject *)t == ctx[C_DTYPE_TYPE])
        return global(w, obj);
    if ((PyObject *)t == ctx[C_DEVICE_TYPE] || (PyObject *)t == ctx[C_SIZE_TYPE])
        return save_reduced(w, obj, (PyObject *)t);
    return unsupported("an object plain_pickle does not write");
}

static PyObject *dump(PyObject *self, PyObject *args)
{
    PyObject *obj, *ctx_tuple, *result = NULL, *ctx[C_COUNT];
    W w;
    Py_ssize_t i;
    if (!PyArg_ParseTuple(args, "OO!", &obj, &PyTuple_Type, &ctx_tuple))
        return NULL;
    if (PyTuple_Size(ctx_tuple) != C_COUNT) {
        PyErr_SetString(PyExc_ValueError, "plain_pickle: a context of the wrong length");
        return NULL;
    }
    for (i = 0; i < C_COUNT; i++)
        ctx[i] = PyTuple_GetItem(ctx_tuple, i);
    memset(&w, 0, sizeof(w));
    w.ctx = ctx;
    w.mask = 1023;
    w.table = PyMem_Calloc(w.mask + 1, sizeof(Slot));
    w.keep = PyList_New(0);
    w.storages = PyDict_New();
    w.keys = PyDict_New();
    w.dtypes = PyDict_New();
    if (!w.table || !w.keep || !w.storages || !w.keys || !w.dtypes) {
        PyErr_NoMemory();
        goto done;
    }
    if (out(&w, "\x80\x02", 2) < 0)
        goto done;
    if (save(&w, obj) < 0 || op(&w, '.') < 0)
        goto done;
    {
        PyObject *data = PyBytes_FromStringAndSize(w.buf, (Py_ssize_t)w.len);
        if (data) {
            result = Py_BuildValue("(OOl)", data, w.storages, w.max_depth);
            Py_DECREF(data);
        }
    }
done:
    PyMem_Free(w.buf);
    PyMem_Free(w.table);
    Py_XDECREF(w.keep);
    Py_XDECREF(w.storages);
    Py_XDECREF(w.keys);
    Py_XDECREF(w.dtypes);
    return result;
}

/* headroom(n) -> how many of n more recursion levels this thread may enter
 * here (n where all of them), counted by the interpreter's own check, which
 * CPython's pickler uses too; nothing is entered when it returns */
static PyObject *headroom(PyObject *self, PyObject *arg)
{
    long n = PyLong_AsLong(arg), i, j;
    if (n == -1 && PyErr_Occurred())
        return NULL;
    for (i = 0; i < n; i++) {
        if (Py_EnterRecursiveCall("")) {
            PyErr_Clear();
            break;
        }
    }
    for (j = 0; j < i; j++)
        Py_LeaveRecursiveCall();
    return PyLong_FromLong(i);
}

static PyMethodDef methods[] = {
    {"dump", dump, METH_VARARGS, "dump(obj, ctx) -> (pickle bytes, {key: storage}, depth); raises Unsupported"},
    {"headroom", headroom, METH_O, "headroom(n) -> how many of n more recursion levels are free here"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "fastpersist._plain_pickle", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__plain_pickle(void)
{
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
#define INTERN(var, text) if (!(var = PyUnicode_InternFromString(text))) return NULL
    INTERN(s_layout, "layout");
    INTERN(s_dict, "__dict__");
    INTERN(s_hooks, "_backward_hooks");
    INTERN(s_is_quantized, "is_quantized");
    INTERN(s_is_nested, "is_nested");
    INTERN(s_device, "device");
    INTERN(s_type, "type");
    INTERN(s_index, "index");
    INTERN(s_requires_grad, "requires_grad");
    INTERN(s_grad_fn, "grad_fn");
    INTERN(s_dtype, "dtype");
    INTERN(s_untyped_storage, "untyped_storage");
    INTERN(s_nbytes, "nbytes");
    INTERN(s_element_size, "element_size");
    INTERN(s_data_ptr, "data_ptr");
    INTERN(s_cdata, "_cdata");
    INTERN(s_storage_offset, "storage_offset");
    INTERN(s_size, "size");
    INTERN(s_stride, "stride");
    INTERN(s_data, "data");
    INTERN(s_items, "items");
#undef INTERN
    Unsupported = PyErr_NewException("fastpersist._plain_pickle.Unsupported", NULL, NULL);
    if (!Unsupported || PyModule_AddObject(m, "Unsupported", Unsupported) < 0)
        return NULL;
    Py_INCREF(Unsupported);
    return m;
}

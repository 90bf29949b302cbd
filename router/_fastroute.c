/* route()'s common case in C: a bare key's ring owner, or the first entry along its probe order, that is
 * available and under its bounded-load limit. Every case this cannot decide exactly as the pure-Python path
 * does (a gated entry, whose admits(now) Python must ask; an unexpected key or attribute type) returns None,
 * and the caller then takes that path. Lookups read one immutable Table built per group and never block. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define MAX_ENTRIES (1 << 20) /* _ring._INDEX_BITS: a ring holds fewer entries */
#define PROBE_ENTRIES (1 << 17) /* bounded() walks rings up to this size (a 16 KiB stack bitmap); Python beyond */
#define EXACT_DOUBLE (1LL << 53) /* ints up to this convert to double exactly, as Python's int/float mixing does */
#define GOLDEN 0x9E3779B97F4A7C15ULL /* _keys.GOLDEN: int keys are Fibonacci-hashed */
#define NO_SLOT UINT32_MAX /* a bucket with a point inside it: Ring.slots' None */

/* CRC-32 as zlib.crc32 (reflected polynomial 0xEDB88320), eight bytes a step ("slicing-by-8"). */
static uint32_t crc_table[8][256];

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][n] = c;
    }
    for (int t = 1; t < 8; t++)
        for (int n = 0; n < 256; n++)
            crc_table[t][n] = (crc_table[t - 1][n] >> 8) ^ crc_table[0][crc_table[t - 1][n] & 0xFF];
}

static uint32_t load_le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint32_t crc32_of(const unsigned char *p, Py_ssize_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (; n >= 8; p += 8, n -= 8) {
        uint32_t lo = c ^ load_le32(p), hi = load_le32(p + 4);
        c = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^ crc_table[5][(lo >> 16) & 0xFF] ^
            crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xFF] ^ crc_table[2][(hi >> 8) & 0xFF] ^
            crc_table[1][(hi >> 16) & 0xFF] ^ crc_table[0][hi >> 24];
    }
    while (n-- > 0) c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

/* _keys.position() for an exact str, bytes or int: 1 with *pos set, 0 for another type, -1 on error. */
static int key_position(PyObject *key, uint32_t *pos) {
    if (PyUnicode_CheckExact(key)) {
        if (PyUnicode_IS_ASCII(key)) { /* ASCII is its own UTF-8: no encoding */
            *pos = crc32_of(PyUnicode_DATA(key), PyUnicode_GET_LENGTH(key));
            return 1;
        }
        PyObject *utf8 = PyUnicode_AsUTF8String(key); /* str.encode(): raises on lone surrogates alike */
        if (utf8 == NULL) return -1;
        *pos = crc32_of((const unsigned char *)PyBytes_AS_STRING(utf8), PyBytes_GET_SIZE(utf8));
        Py_DECREF(utf8);
        return 1;
    }
    if (PyBytes_CheckExact(key)) {
        *pos = crc32_of((const unsigned char *)PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
        return 1;
    }
    if (PyLong_CheckExact(key)) {
        *pos = (uint32_t)((PyLong_AsUnsignedLongLongMask(key) * GOLDEN) >> 32); /* key mod 2^64, never fails */
        return 1;
    }
    return 0;
}

typedef struct {
    PyObject *state;    /* EndpointState, borrowed from the entries tuple the Table holds */
    PyObject *endpoint; /* Endpoint, borrowed likewise */
    double safe, base_load, inv_share;
} Entry;

/* Not tracked by the GC: it refers only to the entries tuple and the InFlight counter, which never refer back. */
typedef struct {
    PyObject_HEAD
    PyObject *entries; /* the group's tuple of (state, safe, base_load, inv_share, endpoint) */
    PyObject *counter; /* the group's InFlight */
    Entry *entry;
    uint32_t *points; /* sorted ring positions */
    uint32_t *owners; /* entry index of each point */
    uint32_t *slots;  /* Ring.slots: the owner of each bucket's positions, NO_SLOT where a point falls inside */
    Py_ssize_t count, npoints;
    int shift;
    double base_total, balance;
    PyTypeObject *state_type; /* every state's exact type, whose slots are read below */
    Py_ssize_t gated_at, inflight_at, value_at; /* offsets of the __slots__ state.gated, .load, counter.value */
} Table;

/* The offset of a __slots__ attribute of `type`. */
static int slot_offset(PyTypeObject *type, const char *name, Py_ssize_t *offset) {
    PyObject *descr = PyObject_GetAttrString((PyObject *)type, name);
    if (descr == NULL) return -1;
    int ok = Py_IS_TYPE(descr, &PyMemberDescr_Type) && ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX;
    if (ok) *offset = ((PyMemberDescrObject *)descr)->d_member->offset;
    Py_DECREF(descr);
    if (!ok) PyErr_Format(PyExc_TypeError, "%s.%s is not a __slots__ attribute", type->tp_name, name);
    return ok ? 0 : -1;
}

/* An int attribute read without Python code: 0 with *out set when it is an exact int within 2^53, else -1. */
static int read_int(PyObject *obj, Py_ssize_t offset, double *out) {
    PyObject *value = *(PyObject **)((char *)obj + offset);
    if (value == NULL || !PyLong_CheckExact(value)) return -1;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || v > EXACT_DOUBLE || v < -EXACT_DOUBLE) return -1;
    *out = (double)v;
    return 0;
}

/* An entry's requests in flight when it is plainly available (gated is False); -1 otherwise (gated: Python
 * asks admits(now); anything unexpected: Python decides too). */
static int usable(Table *t, PyObject *state, double *inflight) {
    return *(PyObject **)((char *)state + t->gated_at) == Py_False ? read_int(state, t->inflight_at, inflight) : -1;
}

/* balance * (base_total + group in flight + 1), in Python's evaluation order (float + int, then + 1). */
static int group_limit(Table *t, double *limit) {
    double value;
    if (read_int(t->counter, t->value_at, &value) < 0) return -1;
    *limit = t->balance * (t->base_total + value + 1.0);
    return 0;
}

/* Ring.index(): the first point at or after pos, wrapping to 0. */
static Py_ssize_t point_index(Table *t, uint32_t pos) {
    Py_ssize_t lo = 0, hi = t->npoints;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (t->points[mid] < pos) lo = mid + 1;
        else hi = mid;
    }
    return lo < t->npoints ? lo : 0;
}

static PyObject *endpoint_of(Table *t, Py_ssize_t index) {
    return Py_NewRef(t->entry[index].endpoint);
}

/* Router._bounded() with nothing excluded, from point `start`; None where a gated entry is met first, or in
   rings of more than PROBE_ENTRIES entries (the pure-Python path walks those). */
static PyObject *bounded(Table *t, Py_ssize_t start) {
    unsigned char seen[PROBE_ENTRIES / 8];
    double limit, inflight, best_load = 0.0;
    Py_ssize_t best = -1, distinct = 0, i = start;
    if (t->count > PROBE_ENTRIES || group_limit(t, &limit) < 0) Py_RETURN_NONE;
    memset(seen, 0, (size_t)(t->count + 7) / 8);
    for (Py_ssize_t step = 0; step < t->npoints && distinct < t->count; step++) { /* one lap at most */
        uint32_t index = t->owners[i];
        i = i + 1 < t->npoints ? i + 1 : 0;
        if (seen[index >> 3] & (1u << (index & 7))) continue;
        seen[index >> 3] |= (unsigned char)(1u << (index & 7));
        distinct++;
        Entry *e = &t->entry[index];
        if (usable(t, e->state, &inflight) < 0) Py_RETURN_NONE;
        if (t->balance == 0.0) return endpoint_of(t, index);
        double load = (inflight + e->base_load) * e->inv_share;
        if (load < limit) return endpoint_of(t, index);
        if (best < 0 || load < best_load) best = index, best_load = load;
    }
    return endpoint_of(t, best); /* the first step returned or set best */
}

static PyObject *Table_route(Table *t, PyObject *key) {
    uint32_t pos;
    int known = key_position(key, &pos);
    if (known < 0) return NULL;
    if (known == 0) Py_RETURN_NONE;
    uint32_t slot = t->slots[pos >> t->shift];
    uint32_t index = slot != NO_SLOT ? slot : t->owners[point_index(t, pos)];
    Entry *e = &t->entry[index];
    double inflight, limit;
    if (usable(t, e->state, &inflight) < 0) Py_RETURN_NONE;
    if (inflight < e->safe) return endpoint_of(t, index);
    if (group_limit(t, &limit) < 0) Py_RETURN_NONE;
    if ((inflight + e->base_load) * e->inv_share < limit) return endpoint_of(t, index);
    return bounded(t, point_index(t, pos)); /* Router._choose()'s first step */
}

/* A new C array of a sequence's ints in [0, high] (None as NO_SLOT where none_ok), its length in *n. */
static uint32_t *u32_of(PyObject *seq, const char *what, int none_ok, long long high, Py_ssize_t *n) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL) return NULL;
    *n = PySequence_Fast_GET_SIZE(fast);
    uint32_t *out = PyMem_Malloc(sizeof(uint32_t) * (size_t)(*n > 0 ? *n : 1));
    if (out == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < *n; i++) {
        if (i > 0 && items[i] == items[i - 1]) { /* Ring.slots repeats one int object over runs of buckets */
            out[i] = out[i - 1];
            continue;
        }
        if (none_ok && items[i] == Py_None) {
            out[i] = NO_SLOT;
            continue;
        }
        long long v = PyLong_AsLongLong(items[i]);
        if (v == -1 && PyErr_Occurred()) goto fail;
        if (v < 0 || v > high) {
            PyErr_Format(PyExc_ValueError, "%s: %lld is outside [0, %lld]", what, v, high);
            goto fail;
        }
        out[i] = (uint32_t)v;
    }
    Py_DECREF(fast);
    return out;
fail:
    Py_DECREF(fast);
    PyMem_Free(out);
    return NULL;
}

static void Table_dealloc(Table *t) {
    Py_XDECREF(t->entries);
    Py_XDECREF(t->counter);
    Py_XDECREF(t->state_type);
    PyMem_Free(t->entry);
    PyMem_Free(t->points);
    PyMem_Free(t->owners);
    PyMem_Free(t->slots);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* The entry array from the entries tuple; every state must share the first one's type, whose slots are read. */
static int fill_entries(Table *t) {
    t->entry = PyMem_Malloc(sizeof(Entry) * (size_t)t->count);
    if (t->entry == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < t->count; i++) {
        PyObject *item = PyTuple_GET_ITEM(t->entries, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 5) {
            PyErr_SetString(PyExc_TypeError, "entries must be (state, safe, base_load, inv_share, endpoint) tuples");
            return -1;
        }
        Entry *e = &t->entry[i];
        e->state = PyTuple_GET_ITEM(item, 0);
        e->endpoint = PyTuple_GET_ITEM(item, 4);
        e->safe = PyFloat_AsDouble(PyTuple_GET_ITEM(item, 1));
        e->base_load = PyFloat_AsDouble(PyTuple_GET_ITEM(item, 2));
        e->inv_share = PyFloat_AsDouble(PyTuple_GET_ITEM(item, 3));
        if (PyErr_Occurred()) return -1;
        if (i == 0) {
            t->state_type = (PyTypeObject *)Py_NewRef(Py_TYPE(e->state));
            if (slot_offset(t->state_type, "gated", &t->gated_at) < 0 ||
                slot_offset(t->state_type, "load", &t->inflight_at) < 0)
                return -1;
        } else if (!Py_IS_TYPE(e->state, t->state_type)) {
            PyErr_Format(PyExc_TypeError, "every state must be a %s", t->state_type->tp_name);
            return -1;
        }
    }
    return 0;
}

static PyObject *Table_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"points", "owners", "slots", "shift", "entries", "base_total", "counter", "balance", NULL};
    PyObject *points, *owners, *slots, *entries, *counter;
    int shift;
    double base_total, balance;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOiO!dOd:Table", names, &points, &owners, &slots, &shift,
                                     &PyTuple_Type, &entries, &base_total, &counter, &balance))
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(entries), nowners, nslots;
    if (count < 1 || count > MAX_ENTRIES || shift < 0 || shift > 31) {
        PyErr_SetString(PyExc_ValueError, "a table needs 1 to 2^20 entries and a shift in [0, 31]");
        return NULL;
    }
    Table *t = (Table *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    t->entries = Py_NewRef(entries);
    t->counter = Py_NewRef(counter);
    t->count = count;
    t->shift = shift;
    t->base_total = base_total;
    t->balance = balance;
    if (fill_entries(t) < 0 || slot_offset(Py_TYPE(counter), "value", &t->value_at) < 0 ||
        (t->points = u32_of(points, "points", 0, UINT32_MAX, &t->npoints)) == NULL ||
        (t->owners = u32_of(owners, "owners", 0, count - 1, &nowners)) == NULL ||
        (t->slots = u32_of(slots, "slots", 1, count - 1, &nslots)) == NULL)
        goto fail;
    if (t->npoints < 1 || nowners != t->npoints || nslots != (Py_ssize_t)1 << (32 - shift)) {
        PyErr_SetString(PyExc_ValueError, "points and owners must match, and slots cover 2^(32 - shift) buckets");
        goto fail;
    }
    for (Py_ssize_t i = 1; i < t->npoints; i++) {
        if (t->points[i] < t->points[i - 1]) {
            PyErr_SetString(PyExc_ValueError, "points must be sorted");
            goto fail;
        }
    }
    return (PyObject *)t;
fail:
    Py_DECREF(t);
    return NULL;
}

static PyMethodDef Table_methods[] = {
    {"route", (PyCFunction)Table_route, METH_O,
     "route(key) -> Endpoint | None: the endpoint for a bare str/bytes/int key; None where Python must decide."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "prismlb.router._fastroute.Table",
    .tp_basicsize = sizeof(Table),
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Table(points, owners, slots, shift, entries, base_total, counter, balance): one group's ring "
              "(Ring.points, .owners, .slots, .shift), its entries and InFlight counter, and Settings.balance.",
    .tp_methods = Table_methods,
    .tp_new = Table_new,
};

static PyObject *position_py(PyObject *Py_UNUSED(module), PyObject *key) {
    uint32_t pos;
    int known = key_position(key, &pos);
    if (known < 0) return NULL;
    if (known == 0) Py_RETURN_NONE;
    return PyLong_FromUnsignedLong(pos);
}

static PyMethodDef module_methods[] = {
    {"position", position_py, METH_O,
     "position(key) -> int | None: _keys.position() of an exact str, bytes or int, as route() computes it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prismlb.router._fastroute",
    .m_doc = "route()'s common case in C.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__fastroute(void) {
    crc_init();
    if (PyType_Ready(&TableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Table", (PyObject *)&TableType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

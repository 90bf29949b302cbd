/* route()'s common case in C, and the prefix index that scores prompts' cached blocks (BlockIndex, below).
 *
 * Table.route(): Group.pick() (router/_snapshot.py, the one definition of the bounded-load rule) for a bare key with
 * nothing excluded: its ring owner while that fits, else the first entry along its probe order that is available
 * and under the bound. The functions below mirror Group's methods of the same names. Every case this cannot decide
 * exactly as Group does (a gated entry, whose admits(now) Python must ask; an unexpected key or attribute type)
 * returns None, and the caller then asks Group. Lookups read one immutable Table built per group and never block;
 * tests/test_router_fast.py checks that both choose alike. */

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

/* Tracked by the GC: its entries' states refer back to their router (EndpointState's peer-load callback), whose
 * snapshot holds the group that holds this table; a table hidden from the collector would keep every router it
 * ever served alive, with its brain-fed state, after the last reference to it went. Immutable like a tuple, it has
 * no tp_clear either: the states and the router in such a cycle are cleared, and route() never meets a table
 * whose entries are gone. */
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

/* Group.limit(): balance * (base_total + group in flight + 1), in Python's evaluation order (float + int, then + 1). */
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

/* Group.bounded() with nothing excluded, from point `start`; None where a gated entry is met first, or in
   rings of more than PROBE_ENTRIES entries (Group walks those). */
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

/* Group.fits(): 1 when the entry is plainly available and under the bound (its `safe` count first), 0 when it is
 * available but not under it, -1 where Python must decide (gated, or anything unexpected). */
static int fits(Table *t, Entry *e) {
    double inflight, limit;
    if (usable(t, e->state, &inflight) < 0) return -1;
    if (inflight < e->safe) return 1;
    if (group_limit(t, &limit) < 0) return -1;
    return (inflight + e->base_load) * e->inv_share < limit;
}

/* Group.pick() with nothing excluded: the owner of `pos` (Ring.owner()) while it fits, else the walk from its point. */
static PyObject *pick(Table *t, uint32_t pos) {
    uint32_t slot = t->slots[pos >> t->shift];
    uint32_t index = slot != NO_SLOT ? slot : t->owners[point_index(t, pos)];
    int owner_fits = fits(t, &t->entry[index]);
    if (owner_fits < 0) Py_RETURN_NONE;
    if (owner_fits) return endpoint_of(t, index);
    return bounded(t, point_index(t, pos));
}

static PyObject *Table_route(Table *t, PyObject *key) {
    uint32_t pos;
    int known = key_position(key, &pos);
    if (known < 0) return NULL;
    if (known == 0) Py_RETURN_NONE;
    return pick(t, pos);
}

/* Converts one item of a sequence into its array slot `out`; 0, or -1 with an exception set. `how` is the caller's. */
typedef int (*Convert)(PyObject *item, const void *how, void *out);

/* A new PyMem array of a sequence's items converted one by one, `size` bytes each, its length in *n; NULL with an
 * exception set on error. An item that is the same object as the one before copies its slot (Ring.slots repeats one
 * int object over runs of buckets). */
static void *array_of(PyObject *seq, const char *what, size_t size, Convert convert, const void *how, Py_ssize_t *n) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL) return NULL;
    *n = PySequence_Fast_GET_SIZE(fast);
    char *out = *n > UINT32_MAX ? NULL : PyMem_Malloc(size * (size_t)(*n > 0 ? *n : 1));
    if (out == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < *n; i++) {
        if (i > 0 && items[i] == items[i - 1])
            memcpy(out + i * size, out + (i - 1) * size, size);
        else if (convert(items[i], how, out + i * size) < 0)
            goto fail;
    }
    Py_DECREF(fast);
    return out;
fail:
    Py_DECREF(fast);
    PyMem_Free(out);
    return NULL;
}

/* What u32_item accepts: ints in [0, high], and None (as NO_SLOT) where none_ok; `what` names the sequence. */
typedef struct {
    const char *what;
    int none_ok;
    long long high;
} U32Range;

static int u32_item(PyObject *item, const void *how, void *out) {
    const U32Range *range = how;
    if (range->none_ok && item == Py_None) {
        *(uint32_t *)out = NO_SLOT;
        return 0;
    }
    long long v = PyLong_AsLongLong(item);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || v > range->high) {
        PyErr_Format(PyExc_ValueError, "%s: %lld is outside [0, %lld]", range->what, v, range->high);
        return -1;
    }
    *(uint32_t *)out = (uint32_t)v;
    return 0;
}

/* A new C array of a sequence's ints in [0, high] (None as NO_SLOT where none_ok), its length in *n. */
static uint32_t *u32_of(PyObject *seq, const char *what, int none_ok, long long high, Py_ssize_t *n) {
    U32Range range = {what, none_ok, high};
    return array_of(seq, what, sizeof(uint32_t), u32_item, &range, n);
}

static int Table_traverse(Table *t, visitproc visit, void *arg) {
    Py_VISIT(t->entries);
    Py_VISIT(t->counter);
    Py_VISIT(t->state_type);
    return 0;
}

static void Table_dealloc(Table *t) {
    PyObject_GC_UnTrack(t);
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
     "route(key) -> Endpoint | None: Group.pick() for a bare str/bytes/int key; None where Python must decide."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "prismlb.router._fastroute.Table",
    .tp_basicsize = sizeof(Table),
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)Table_traverse,
    .tp_doc = "Table(points, owners, slots, shift, entries, base_total, counter, balance): one group's ring "
              "(Ring.points, .owners, .slots, .shift), its entries and InFlight counter, and Settings.balance.",
    .tp_methods = Table_methods,
    .tp_new = Table_new,
};

/* ---------------------------------------------------------------------------------------------------------
 * BlockIndex: PrefixIndex's tables (router/_index.py documents what they mean) in compact C arrays.
 *
 * One open-addressing table (linear probing, backward-shift deletion, load at most 0.7, doubling) maps a block
 * hash to its holders, one per node. A holder is a node ordinal with two flags: HELD (the node's events say it
 * caches the block) and CLAIMED (this router's placement claims it; `seq` names that placement's record in the
 * claims FIFO, which keeps its `until`). So one lookup answers both layers for match(). A block with one holder
 * keeps it inline in its 16-byte slot, the common case: 1M blocks cached once each take 2^21 slots, 32 MiB. A
 * block with several holders points to a Set, sorted by ordinal so that match() binary-searches it.
 *
 * Each method converts and checks its arguments first (which may run Python code: a generator of blocks), then
 * reads or changes the tables without running Python code and without releasing the GIL, so that callers in
 * several threads each see whole calls: the GIL is the lock. */

#define EMPTY 0u                /* Slot.h.who of a free slot */
#define SET 1u                  /* Slot.h.who of a block with several holders; Slot.h.seq indexes sets */
#define HELD 0x80000000u        /* Holder.who: the node's events say it holds the block */
#define CLAIMED 0x40000000u     /* Holder.who: a placement claims the block there until claims[seq].until */
#define ORDINAL 0x3FFFFFFFu     /* Holder.who: the node's ordinal; a holder always has a flag, so never EMPTY/SET */
#define NO_NODE UINT32_MAX      /* end of the free-ordinal chain */
#define MIN_BITS 6              /* a new table has 64 slots */
#define MAX_BITS 31             /* slot positions fit in 31 bits (match's cache marks live above them) */
#define UNKNOWN UINT32_MAX      /* match's cache: block not looked up yet */
#define ABSENT (UINT32_MAX - 1) /* match's cache: no node holds the block */
#define STACK_BLOCKS 256        /* match() caches the lookups of prompts up to this many blocks on the stack */
#define STACK_NODES 16          /* and the depths of up to this many nodes */

typedef struct {
    uint32_t who; /* ordinal | HELD | CLAIMED, or EMPTY / SET in a slot */
    uint32_t seq; /* the claim's record while CLAIMED; the set's index in a SET slot */
} Holder;

typedef struct {
    uint64_t block;
    Holder h;
} Slot;

typedef struct {
    uint32_t len, cap, held; /* held: holders with HELD, so that len() counts the block while it is above 0 */
    Holder h[];              /* sorted by ordinal */
} Set;

typedef struct {
    double until;
    uint64_t *blocks; /* the placement's blocks, owned */
    uint32_t node, n;
} Claim;

typedef struct {
    PyObject *id;       /* the node id, an exact str; NULL while the ordinal is free */
    uint64_t size;      /* blocks held: size() */
    uint32_t records;   /* claims records naming this ordinal */
    uint32_t next_free; /* the free-ordinal chain */
    int dropped;        /* drop()ped while records still name it: the ordinal is freed with the last of them */
} Node;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    uint32_t bits, mask, used; /* 2^bits slots, used of them occupied */
    Py_ssize_t held_blocks;    /* blocks with a HELD holder: len() */
    Set **sets;                /* NULL where free; free indexes are stacked in free_sets */
    uint32_t *free_sets;
    uint32_t nsets, sets_cap, nfree;
    PyObject *ids;             /* node id -> ordinal */
    Node *nodes;
    uint32_t nnodes, nodes_cap, free_node;
    Claim *claims;                   /* a ring: record seq at claims[seq % claims_cap], live from head to tail - 1 */
    uint32_t claims_cap, head, tail; /* seq numbers wrap around; claims_cap is a power of 2, so % stays right */
    uint64_t claimed;                /* blocks the live records name, duplicates included: _PyTables._claimed */
    double ttl;
    Py_ssize_t max_placed;
} BlockIndex;

static inline uint32_t home(const BlockIndex *x, uint64_t block) {
    return (uint32_t)((block * GOLDEN) >> (64 - x->bits)); /* Fibonacci hashing: sequential hashes spread too */
}

static Slot *find_slot(const BlockIndex *x, uint64_t block) {
    for (uint32_t i = home(x, block);; i = (i + 1) & x->mask) { /* ends: the load keeps free slots */
        Slot *s = &x->slots[i];
        if (s->h.who == EMPTY) return NULL;
        if (s->block == block) return s;
    }
}

/* Where node `ord` would sit in a set: *found says whether it is there. */
static uint32_t set_position(const Set *set, uint32_t ord, int *found) {
    uint32_t lo = 0, hi = set->len;
    while (lo < hi) {
        uint32_t mid = (lo + hi) >> 1, at = set->h[mid].who & ORDINAL;
        if (at == ord) {
            *found = 1;
            return mid;
        }
        if (at < ord) lo = mid + 1;
        else hi = mid;
    }
    *found = 0;
    return lo;
}

static Holder *find_holder(const BlockIndex *x, Slot *s, uint32_t ord) {
    if (s->h.who != SET) return (s->h.who & ORDINAL) == ord ? &s->h : NULL;
    Set *set = x->sets[s->h.seq];
    int found;
    uint32_t at = set_position(set, ord, &found);
    return found ? &set->h[at] : NULL;
}

static inline double until_of(const BlockIndex *x, uint32_t seq) {
    return x->claims[seq & (x->claims_cap - 1)].until;
}

/* Whether a holder counts at `now`: the node's events hold the block, or a placement claims it past now. */
static inline int live(const BlockIndex *x, const Holder *h, double now) {
    return (h->who & HELD) || ((h->who & CLAIMED) && until_of(x, h->seq) > now);
}

static int resize(BlockIndex *x, uint32_t bits) {
    if (bits > MAX_BITS) {
        PyErr_NoMemory();
        return -1;
    }
    Slot *slots = PyMem_Calloc((size_t)1 << bits, sizeof(Slot)); /* zeroed: every who is EMPTY */
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Slot *old = x->slots;
    uint32_t old_count = old == NULL ? 0 : x->mask + 1;
    x->slots = slots;
    x->bits = bits;
    x->mask = (uint32_t)(((uint64_t)1 << bits) - 1);
    for (uint32_t i = 0; i < old_count; i++) {
        if (old[i].h.who == EMPTY) continue;
        uint32_t j = home(x, old[i].block);
        while (slots[j].h.who != EMPTY) j = (j + 1) & x->mask;
        slots[j] = old[i];
    }
    PyMem_Free(old);
    return 0;
}

/* A free slot for a block the table lacks, after doubling the table where one more would pass the 0.7 load. */
static Slot *new_slot(BlockIndex *x, uint64_t block) {
    if ((uint64_t)(x->used + 1) * 10 > ((uint64_t)x->mask + 1) * 7 && resize(x, x->bits + 1) < 0) return NULL;
    uint32_t i = home(x, block);
    while (x->slots[i].h.who != EMPTY) i = (i + 1) & x->mask;
    x->used++;
    x->slots[i].block = block;
    return &x->slots[i];
}

/* Backward-shift deletion: each later slot of the probe run moves into the hole when its home is not between
 * the hole and itself, so that lookups never meet a gap before their block, and no tombstones are needed. */
static void delete_slot(BlockIndex *x, Slot *s) {
    uint32_t hole = (uint32_t)(s - x->slots), j = hole;
    for (;;) {
        j = (j + 1) & x->mask;
        if (x->slots[j].h.who == EMPTY) break;
        uint32_t k = home(x, x->slots[j].block);
        if (((j - k) & x->mask) >= ((j - hole) & x->mask)) { /* the hole lies within [k, j): move back */
            x->slots[hole] = x->slots[j];
            hole = j;
        }
    }
    x->slots[hole].h.who = EMPTY;
    x->used--;
}

/* PyMem_Realloc that raises MemoryError when it fails (`array` is then left as it was). */
static void *regrown(void *array, size_t bytes) {
    void *grown = PyMem_Realloc(array, bytes);
    if (grown == NULL) PyErr_NoMemory();
    return grown;
}

/* A new empty set of room `cap`: its index, or -1. */
static int64_t new_set(BlockIndex *x, uint32_t cap) {
    if (x->nfree == 0 && x->nsets == x->sets_cap) {
        uint32_t grown = x->sets_cap ? x->sets_cap * 2 : 16;
        if (grown <= x->sets_cap) {
            PyErr_NoMemory();
            return -1;
        }
        Set **sets = regrown(x->sets, sizeof(Set *) * grown);
        if (sets == NULL) return -1;
        x->sets = sets;
        uint32_t *free_sets = regrown(x->free_sets, sizeof(uint32_t) * grown);
        if (free_sets == NULL) return -1;
        x->free_sets = free_sets;
        x->sets_cap = grown;
    }
    Set *set = PyMem_Malloc(sizeof(Set) + sizeof(Holder) * cap);
    if (set == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    set->len = set->held = 0;
    set->cap = cap;
    uint32_t i = x->nfree ? x->free_sets[--x->nfree] : x->nsets++;
    x->sets[i] = set;
    return i;
}

static void free_set(BlockIndex *x, uint32_t i) {
    PyMem_Free(x->sets[i]);
    x->sets[i] = NULL;
    x->free_sets[x->nfree++] = i; /* room: free_sets is as long as sets */
}

/* Sets `flag` (HELD or CLAIMED) on node `ord`'s holder of `block`, adding the holder, and the block, where
 * missing; *holder is the holder. 1 when the flag is new, 0 when it was set already, -1 on error. */
static int add(BlockIndex *x, uint64_t block, uint32_t ord, uint32_t flag, Holder **holder) {
    Slot *s = find_slot(x, block);
    Set *set = NULL;
    Holder *h;
    if (s == NULL) {
        if ((s = new_slot(x, block)) == NULL) return -1;
        s->h.who = ord | flag;
        s->h.seq = 0;
        if (flag == HELD) x->held_blocks++, x->nodes[ord].size++;
        *holder = &s->h;
        return 1;
    }
    if (s->h.who != SET && (s->h.who & ORDINAL) == ord) {
        h = &s->h;
    } else if (s->h.who != SET) { /* a second holder: the block moves to a set */
        int64_t i = new_set(x, 4);
        if (i < 0) return -1;
        set = x->sets[i];
        Holder other = s->h, mine = {ord, 0};
        int after = (other.who & ORDINAL) < ord;
        set->h[!after] = other;
        set->h[after] = mine;
        h = &set->h[after];
        set->len = 2;
        set->held = (other.who & HELD) != 0;
        s->h.who = SET;
        s->h.seq = (uint32_t)i;
    } else {
        set = x->sets[s->h.seq];
        int found;
        uint32_t at = set_position(set, ord, &found);
        if (!found) {
            if (set->len == set->cap) {
                Set *grown = regrown(set, sizeof(Set) + sizeof(Holder) * (size_t)set->cap * 2);
                if (grown == NULL) return -1;
                set = x->sets[s->h.seq] = grown;
                set->cap *= 2;
            }
            memmove(&set->h[at + 1], &set->h[at], sizeof(Holder) * (set->len - at));
            set->h[at] = (Holder){ord, 0};
            set->len++;
        }
        h = &set->h[at];
    }
    *holder = h;
    if (h->who & flag) return 0;
    if (flag == HELD) {
        if (set == NULL || set->held++ == 0) x->held_blocks++; /* inline: h, flagless for HELD, was alone */
        x->nodes[ord].size++;
    }
    h->who |= flag;
    return 1;
}

/* Clears `flags` on holder h of slot s; a holder left without a flag goes, and so does a block left alone. */
static void clear(BlockIndex *x, Slot *s, Holder *h, uint32_t flags) {
    uint32_t gone = h->who & flags;
    if (gone == 0) return;
    Set *set = s->h.who == SET ? x->sets[s->h.seq] : NULL;
    if (gone & HELD) {
        x->nodes[h->who & ORDINAL].size--;
        if (set == NULL || --set->held == 0) x->held_blocks--;
    }
    h->who &= ~gone;
    if (h->who & (HELD | CLAIMED)) return;
    if (set == NULL) {
        delete_slot(x, s);
        return;
    }
    uint32_t at = (uint32_t)(h - set->h);
    memmove(&set->h[at], &set->h[at + 1], sizeof(Holder) * (set->len - at - 1));
    if (--set->len == 1) { /* back inline */
        uint32_t i = s->h.seq;
        s->h = set->h[0];
        free_set(x, i);
    }
}

/* The node id as an exact str (new reference): str subclasses are copied, so that lookups run no Python code. */
static PyObject *node_id(PyObject *node) {
    if (!PyUnicode_Check(node)) {
        PyErr_Format(PyExc_TypeError, "a node id must be a str, not %.100s", Py_TYPE(node)->tp_name);
        return NULL;
    }
    return PyUnicode_FromObject(node);
}

/* A node's ordinal: -1 when it has none (and `create` is 0), -2 on error. With `create`, an unknown node gets
 * one, and a dropped one whose ordinal records still name is kept again. */
static int64_t ordinal(BlockIndex *x, PyObject *id, int create) {
    PyObject *value = PyDict_GetItemWithError(x->ids, id);
    if (value != NULL) {
        uint32_t ord = (uint32_t)PyLong_AsUnsignedLong(value); /* an int this type stored: no error */
        if (create) x->nodes[ord].dropped = 0;
        return ord;
    }
    if (PyErr_Occurred()) return -2;
    if (!create) return -1;
    uint32_t ord = x->free_node;
    if (ord == NO_NODE) {
        if (x->nnodes == ORDINAL) {
            PyErr_SetString(PyExc_OverflowError, "too many nodes for a BlockIndex");
            return -2;
        }
        if (x->nnodes == x->nodes_cap) {
            uint32_t grown = x->nodes_cap ? (x->nodes_cap > ORDINAL / 2 ? ORDINAL : x->nodes_cap * 2) : 16;
            Node *nodes = regrown(x->nodes, sizeof(Node) * grown);
            if (nodes == NULL) return -2;
            x->nodes = nodes;
            x->nodes_cap = grown;
        }
        ord = x->nnodes;
    }
    value = PyLong_FromUnsignedLong(ord);
    if (value == NULL || PyDict_SetItem(x->ids, id, value) < 0) {
        Py_XDECREF(value);
        return -2;
    }
    Py_DECREF(value);
    if (ord == x->nnodes) x->nnodes++;
    else x->free_node = x->nodes[ord].next_free;
    x->nodes[ord] = (Node){.id = Py_NewRef(id), .next_free = NO_NODE};
    return ord;
}

/* The ordinal of the node a caller's node id names, never a new one: -1 when it has none, -2 on error (an id that is
 * not a str included). */
static int64_t known_ordinal(BlockIndex *x, PyObject *node) {
    PyObject *id = node_id(node);
    if (id == NULL) return -2;
    int64_t ord = ordinal(x, id, 0);
    Py_DECREF(id);
    return ord;
}

/* Frees a dropped node's ordinal once nothing names it: no holder (drop() cleared them) and no record. */
static void release_node(BlockIndex *x, uint32_t ord) {
    Node *node = &x->nodes[ord];
    PyObject *id = node->id;
    int gone = PyDict_DelItem(x->ids, id); /* cannot fail: ids maps every node that has an id */
    assert(gone == 0);
    (void)gone;
    *node = (Node){.next_free = x->free_node};
    x->free_node = ord;
    Py_DECREF(id);
}

/* Drops the oldest placement record: each of its claims goes unless a later placement renewed it with another
 * `until` (_PyTables._drop_claim compares the untils, so this compares them too). A claim names the record
 * that set it last, never an older one, so the records its seq names are still in the ring. */
static void pop_claim(BlockIndex *x) {
    uint32_t seq = x->head++;
    Claim *c = &x->claims[seq & (x->claims_cap - 1)]; /* stays intact until a later record reuses the place */
    x->claimed -= c->n;
    for (uint32_t k = 0; k < c->n; k++) {
        Slot *s = find_slot(x, c->blocks[k]);
        Holder *h = s == NULL ? NULL : find_holder(x, s, c->node);
        /* seq == h->seq too: a NaN until equals nothing, and a claim must not outlive its record */
        if (h != NULL && (h->who & CLAIMED) && (h->seq == seq || until_of(x, h->seq) == c->until))
            clear(x, s, h, CLAIMED);
    }
    PyMem_Free(c->blocks);
    c->blocks = NULL;
    Node *node = &x->nodes[c->node];
    if (--node->records == 0 && node->dropped) release_node(x, c->node);
}

/* Room in the claims ring for one more record. */
static int reserve_claim(BlockIndex *x) {
    if (x->tail - x->head < x->claims_cap) return 0;
    if (x->claims_cap >= (1u << 30)) {
        PyErr_NoMemory();
        return -1;
    }
    uint32_t cap = x->claims_cap ? x->claims_cap * 2 : 16;
    Claim *ring = PyMem_Malloc(sizeof(Claim) * cap);
    if (ring == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint32_t seq = x->head; seq != x->tail; seq++) ring[seq & (cap - 1)] = x->claims[seq & (x->claims_cap - 1)];
    PyMem_Free(x->claims);
    x->claims = ring;
    x->claims_cap = cap;
    return 0;
}

/* One block hash: an int in [0, 2^64). */
static int hash_of(PyObject *item, uint64_t *out) {
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "a block hash must be an int, not %.100s", Py_TYPE(item)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(item);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError))
            PyErr_Format(PyExc_OverflowError, "a block hash must be in [0, 2**64), got %R", item);
        return -1;
    }
    *out = v;
    return 0;
}

static int hash_item(PyObject *item, const void *how, void *out) {
    (void)how;
    return hash_of(item, out);
}

/* The hashes of an iterable of blocks as a new PyMem array, *n of them; NULL on error. */
static uint64_t *hashes_of(PyObject *blocks, Py_ssize_t *n) {
    return array_of(blocks, "blocks must be an iterable of ints", sizeof(uint64_t), hash_item, NULL, n);
}

/* Node `ord`'s holders with a flag in `which` lose both flags (drop(): every one; reset(): those it held,
 * as _PyTables._forget removes them). A scan of the whole table: drop and reset are rare. */
static int forget(BlockIndex *x, uint32_t ord, uint32_t which) {
    uint64_t *blocks = NULL;
    size_t n = 0, cap = 0;
    for (uint64_t i = 0; i <= x->mask; i++) { /* collect first: clear() shifts slots */
        Slot *s = &x->slots[i];
        if (s->h.who == EMPTY) continue;
        Holder *h = find_holder(x, s, ord);
        if (h == NULL || !(h->who & which)) continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 256;
            uint64_t *grown = regrown(blocks, sizeof(uint64_t) * cap);
            if (grown == NULL) {
                PyMem_Free(blocks);
                return -1;
            }
            blocks = grown;
        }
        blocks[n++] = s->block;
    }
    for (size_t k = 0; k < n; k++) {
        Slot *s = find_slot(x, blocks[k]);
        clear(x, s, find_holder(x, s, ord), HELD | CLAIMED);
    }
    PyMem_Free(blocks);
    return 0;
}

/* HELD on node `ord`'s holder of each block. */
static int store(BlockIndex *x, uint32_t ord, const uint64_t *hashes, Py_ssize_t n) {
    Holder *h;
    for (Py_ssize_t i = 0; i < n; i++)
        if (add(x, hashes[i], ord, HELD, &h) < 0) return -1;
    return 0;
}

/* What stored/removed/reset do with node `id` and the hashes of its blocks: 0, or -1 with an exception set. */
typedef int (*NodeBlocksOp)(BlockIndex *x, PyObject *id, const uint64_t *hashes, Py_ssize_t n);

static int stored_op(BlockIndex *x, PyObject *id, const uint64_t *hashes, Py_ssize_t n) {
    if (n == 0) return 0;
    int64_t ord = ordinal(x, id, 1);
    return ord == -2 ? -1 : store(x, (uint32_t)ord, hashes, n);
}

static int removed_op(BlockIndex *x, PyObject *id, const uint64_t *hashes, Py_ssize_t n) {
    int64_t ord = ordinal(x, id, 0);
    for (Py_ssize_t i = 0; ord >= 0 && i < n; i++) {
        Slot *s = find_slot(x, hashes[i]);
        Holder *h = s == NULL ? NULL : find_holder(x, s, (uint32_t)ord);
        if (h != NULL) clear(x, s, h, HELD | CLAIMED);
    }
    return ord == -2 ? -1 : 0;
}

static int reset_op(BlockIndex *x, PyObject *id, const uint64_t *hashes, Py_ssize_t n) {
    int64_t ord = ordinal(x, id, n > 0);
    int ok = ord != -2 && (ord == -1 || x->nodes[ord].size == 0 || forget(x, (uint32_t)ord, HELD) == 0) &&
             (n == 0 || store(x, (uint32_t)ord, hashes, n) == 0);
    return ok ? 0 : -1;
}

/* stored/removed/reset's frame: the node id and the hashes converted, `op` run with them, both released. */
static PyObject *node_blocks(BlockIndex *x, PyObject *args, const char *format, NodeBlocksOp op) {
    PyObject *node, *blocks;
    if (!PyArg_ParseTuple(args, format, &node, &blocks)) return NULL;
    Py_ssize_t n;
    uint64_t *hashes = hashes_of(blocks, &n); /* first: it may run Python code, ordinal() must not precede it */
    if (hashes == NULL) return NULL;
    PyObject *id = node_id(node);
    int ok = id != NULL && op(x, id, hashes, n) == 0;
    Py_XDECREF(id);
    PyMem_Free(hashes);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyObject *BlockIndex_stored(BlockIndex *x, PyObject *args) {
    return node_blocks(x, args, "OO:stored", stored_op);
}

static PyObject *BlockIndex_removed(BlockIndex *x, PyObject *args) {
    return node_blocks(x, args, "OO:removed", removed_op);
}

static PyObject *BlockIndex_reset(BlockIndex *x, PyObject *args) {
    return node_blocks(x, args, "OO:reset", reset_op);
}

static PyObject *BlockIndex_drop(BlockIndex *x, PyObject *node) {
    int64_t ord = known_ordinal(x, node);
    if (ord == -2) return NULL;
    if (ord == -1) Py_RETURN_NONE;
    if (forget(x, (uint32_t)ord, HELD | CLAIMED) < 0) return NULL;
    if (x->nodes[ord].records == 0) release_node(x, (uint32_t)ord);
    else x->nodes[ord].dropped = 1;
    Py_RETURN_NONE;
}

static PyObject *BlockIndex_placed(BlockIndex *x, PyObject *args) {
    PyObject *node, *blocks;
    double now;
    if (!PyArg_ParseTuple(args, "OOd:placed", &node, &blocks, &now)) return NULL;
    if (x->ttl == 0.0 || x->max_placed == 0) Py_RETURN_NONE;
    Py_ssize_t n;
    uint64_t *hashes = hashes_of(blocks, &n);
    if (hashes == NULL) return NULL;
    PyObject *id = node_id(node);
    if (id == NULL || n == 0) {
        PyMem_Free(hashes);
        Py_XDECREF(id);
        return id == NULL ? NULL : Py_NewRef(Py_None);
    }
    while (x->tail != x->head && x->claims[x->head & (x->claims_cap - 1)].until <= now) pop_claim(x);
    int64_t ord = reserve_claim(x) < 0 ? -2 : ordinal(x, id, 1);
    Py_DECREF(id);
    if (ord == -2) {
        PyMem_Free(hashes);
        return NULL;
    }
    uint32_t seq = x->tail, done = 0;
    Holder *h;
    for (; done < (uint32_t)n && add(x, hashes[done], (uint32_t)ord, CLAIMED, &h) >= 0; done++) h->seq = seq;
    /* the record names the blocks claimed, all of them unless an allocation failed */
    x->claims[seq & (x->claims_cap - 1)] = (Claim){now + x->ttl, hashes, (uint32_t)ord, done};
    x->tail++;
    x->nodes[ord].records++;
    x->claimed += done;
    while (x->claimed > (uint64_t)x->max_placed) pop_claim(x);
    if (done < (uint32_t)n) return NULL;
    Py_RETURN_NONE;
}

typedef struct {
    PyObject *id; /* the node's id, borrowed from nodes[] */
    uint32_t depth;
} Depth;

/* The slot position of prompt block i, looked up once per match() call: every node's binary search starts at
 * the same middle block. -1 with an exception for a block that is not an int in [0, 2^64). */
static int64_t position_of(const BlockIndex *x, PyObject **items, uint32_t *cache, Py_ssize_t i) {
    if (cache[i] == UNKNOWN) {
        uint64_t block;
        if (hash_of(items[i], &block) < 0) return -1;
        Slot *s = find_slot(x, block);
        cache[i] = s == NULL ? ABSENT : (uint32_t)(s - x->slots);
    }
    return cache[i];
}

/* Each live holder of the first block, and the length of its leading run by binary search (see match()), into
 * *out, which has room for `room` and is replaced by a PyMem array where the first block has more holders. */
static Py_ssize_t depths(const BlockIndex *x, PyObject **items, Py_ssize_t n, double now, uint32_t *cache,
                         Depth **out, Py_ssize_t room) {
    int64_t first = position_of(x, items, cache, 0);
    if (first < 0) return -1;
    if (first == ABSENT) return 0;
    Slot *s0 = &x->slots[first];
    Holder *holders = s0->h.who == SET ? x->sets[s0->h.seq]->h : &s0->h;
    Py_ssize_t count = s0->h.who == SET ? x->sets[s0->h.seq]->len : 1, found = 0;
    if (count > room && (*out = PyMem_Malloc(sizeof(Depth) * (size_t)count)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        if (!live(x, &holders[k], now)) continue;
        uint32_t ord = holders[k].who & ORDINAL;
        Py_ssize_t low = 1, high = n; /* it holds blocks[:low]; the answer is within [low, high] */
        while (low < high) {
            Py_ssize_t mid = (low + high + 1) >> 1;
            int64_t at = position_of(x, items, cache, mid - 1);
            if (at < 0) return -1;
            Holder *h = at == ABSENT ? NULL : find_holder(x, &x->slots[at], ord);
            if (h != NULL && live(x, h, now)) low = mid;
            else high = mid - 1;
        }
        (*out)[found++] = (Depth){x->nodes[ord].id, (uint32_t)low};
    }
    return found;
}

static PyObject *BlockIndex_match(BlockIndex *x, PyObject *args) {
    PyObject *blocks;
    double now;
    if (!PyArg_ParseTuple(args, "Od:match", &blocks, &now)) return NULL;
    PyObject *fast = PySequence_Fast(blocks, "blocks must be a sequence of ints");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), found = 0;
    uint32_t stack_cache[STACK_BLOCKS], *cache = stack_cache;
    Depth stack_out[STACK_NODES], *out = stack_out;
    PyObject *result = NULL;
    if (n > STACK_BLOCKS && (cache = PyMem_Malloc(sizeof(uint32_t) * (size_t)n)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (n > 0) {
        memset(cache, 0xFF, sizeof(uint32_t) * (size_t)n); /* UNKNOWN */
        found = depths(x, PySequence_Fast_ITEMS(fast), n, now, cache, &out, STACK_NODES);
        if (found < 0) goto done;
    }
    /* The dict last, with its own references to the ids: creating it may run Python code (a collection that
     * calls finalizers), and with it another thread that changes the tables, even drops these nodes. */
    for (Py_ssize_t k = 0; k < found; k++) Py_INCREF(out[k].id);
    result = PyDict_New();
    for (Py_ssize_t k = 0; result != NULL && k < found; k++) {
        PyObject *depth = PyLong_FromUnsignedLong(out[k].depth);
        if (depth == NULL || PyDict_SetItem(result, out[k].id, depth) < 0) Py_CLEAR(result);
        Py_XDECREF(depth);
    }
    for (Py_ssize_t k = 0; k < found; k++) Py_DECREF(out[k].id);
done:
    if (cache != stack_cache) PyMem_Free(cache);
    if (out != stack_out) PyMem_Free(out);
    Py_DECREF(fast);
    return result;
}

static PyObject *BlockIndex_size(BlockIndex *x, PyObject *node) {
    int64_t ord = known_ordinal(x, node);
    if (ord == -2) return NULL;
    return PyLong_FromUnsignedLongLong(ord == -1 ? 0 : x->nodes[ord].size);
}

static Py_ssize_t BlockIndex_len(BlockIndex *x) {
    return x->held_blocks;
}

static void BlockIndex_dealloc(BlockIndex *x) {
    for (uint32_t seq = x->head; seq != x->tail; seq++) PyMem_Free(x->claims[seq & (x->claims_cap - 1)].blocks);
    PyMem_Free(x->claims);
    for (uint32_t i = 0; i < x->nsets; i++) PyMem_Free(x->sets[i]);
    PyMem_Free(x->sets);
    PyMem_Free(x->free_sets);
    PyMem_Free(x->slots);
    for (uint32_t i = 0; i < x->nnodes; i++) Py_XDECREF(x->nodes[i].id);
    PyMem_Free(x->nodes);
    Py_XDECREF(x->ids);
    Py_TYPE(x)->tp_free((PyObject *)x);
}

static PyObject *BlockIndex_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"placed_ttl_s", "max_placed", NULL};
    double ttl;
    Py_ssize_t max_placed;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "dn:BlockIndex", names, &ttl, &max_placed)) return NULL;
    if (ttl < 0 || max_placed < 0) {
        PyErr_SetString(PyExc_ValueError, "placed_ttl_s and max_placed must not be negative");
        return NULL;
    }
    BlockIndex *x = (BlockIndex *)type->tp_alloc(type, 0); /* zeroed */
    if (x == NULL) return NULL;
    x->ttl = ttl;
    x->max_placed = max_placed;
    x->free_node = NO_NODE;
    if ((x->ids = PyDict_New()) == NULL || resize(x, MIN_BITS) < 0) {
        Py_DECREF(x);
        return NULL;
    }
    return (PyObject *)x;
}

static PyMethodDef BlockIndex_methods[] = {
    {"stored", (PyCFunction)BlockIndex_stored, METH_VARARGS, "stored(node, blocks): the node's engine cached blocks."},
    {"removed", (PyCFunction)BlockIndex_removed, METH_VARARGS,
     "removed(node, blocks): the node's engine evicted blocks; their claims there go too."},
    {"reset", (PyCFunction)BlockIndex_reset, METH_VARARGS, "reset(node, blocks): the node's whole cache is blocks."},
    {"drop", (PyCFunction)BlockIndex_drop, METH_O, "drop(node): forget the node's blocks and claims."},
    {"placed", (PyCFunction)BlockIndex_placed, METH_VARARGS,
     "placed(node, blocks, now): claim blocks there until now + placed_ttl_s."},
    {"match", (PyCFunction)BlockIndex_match, METH_VARARGS,
     "match(blocks, now) -> dict[str, int]: per node holding the first block, its leading run of held blocks."},
    {"size", (PyCFunction)BlockIndex_size, METH_O, "size(node) -> int: blocks the node's events say it holds."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef BlockIndex_members[] = {
    {"placed_ttl_s", T_DOUBLE, offsetof(BlockIndex, ttl), READONLY, "how long a placement's claims last"},
    {"max_placed", T_PYSSIZET, offsetof(BlockIndex, max_placed), READONLY, "blocks placements may claim at once"},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods BlockIndex_as_sequence = {.sq_length = (lenfunc)BlockIndex_len};

/* Not tracked by the GC: it refers only to its dict of str ids to int ordinals, which cannot refer back. */
static PyTypeObject BlockIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "prismlb.router._fastroute.BlockIndex",
    .tp_basicsize = sizeof(BlockIndex),
    .tp_dealloc = (destructor)BlockIndex_dealloc,
    .tp_as_sequence = &BlockIndex_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "BlockIndex(placed_ttl_s, max_placed): PrefixIndex's tables in C (see router/_index.py).",
    .tp_methods = BlockIndex_methods,
    .tp_members = BlockIndex_members,
    .tp_new = BlockIndex_new,
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
    .m_doc = "route()'s common case, and the prefix index's tables, in C.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__fastroute(void) {
    crc_init();
    if (PyType_Ready(&TableType) < 0 || PyType_Ready(&BlockIndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Table", (PyObject *)&TableType) < 0 ||
        PyModule_AddObjectRef(m, "BlockIndex", (PyObject *)&BlockIndexType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

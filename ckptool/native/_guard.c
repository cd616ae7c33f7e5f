/* The opcode guard's walk in C: what ckptool/pickles/opcode_guard.py's _Walk.run does, opcode by opcode.

   The Python walk is the reference; this one must give exactly its results: the pickle's length, the
   256 opcode counts and the globals named, or Truncated (the bytes end before STOP), or a refusal with
   the same message (opcode_guard wraps it with limits.refuse). It walks every opcode (the Python walk's
   one-step state-dict entry is a Python optimisation with the same results).

   The input is hostile. Every read is checked against the buffer's length; lengths read from the
   pickle are 64-bit and compared without overflow; the stack, marks and memo only grow by what the
   opcodes read push (the memo refuses an index past the opcodes read before storing it); nothing
   recurses over the pickle's depth; every exit frees what the walk allocated. The GIL is held
   throughout, and no Python code the pickle could name is ever called: the only Python objects made
   are ints, floats, tuples of them, str names, and the dicts and sets that hold keys' hashes (what
   the Python walk's ``buckets`` hold), compared and hashed by the interpreter's own built-in types. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------- records */

enum { K_STR, K_LITERAL, K_BYTES, K_TUPLE, K_GLOBAL, K_OBJECT, K_CONTAINER, K_LIST, K_OTHER };
static const char *const KIND_NAMES[] = {"str", "literal", "bytes", "tuple", "global", "object", "container",
                                         "list", "other"};

/* what a record's ``value`` is: OPAQUE (the guard cannot know it), how to make it, or made (V_OBJ) */
enum { V_OPAQUE, V_INT, V_FLOAT, V_BIGLE, V_TUPLE, V_OBJ };

/* flags of a global's or object's name (computed once, on first use); a tuple's ``flags`` is its depth instead */
#define N_KNOWN 1u
#define N_TORCH 2u  /* in TORCH_GLOBALS */
#define N_VALUE 4u  /* builds a hashable value: "_codecs.encode", "builtins.complex" (opcode_guard._VALUES) */
#define N_ODICT 8u  /* "collections.OrderedDict" */

/* 32 bytes: a 100k-tensor pickle makes ~600k of them */
typedef struct Rec Rec;
struct Rec {
    uint8_t kind, hashable, vkind, flags;
    uint32_t len;  /* K_STR: the name's length; V_TUPLE: items; V_BIGLE: bytes */
    int64_t nodes;
    union {
        const unsigned char *sname;  /* K_STR: the raw bytes (at most 256), or NULL (no name) */
        PyObject *gname;             /* K_GLOBAL, K_OBJECT: the full name (the walk's names list holds it), or NULL */
    } n;
    union {
        int64_t i;                /* V_INT */
        double f;                 /* V_FLOAT */
        const unsigned char *p;   /* V_BIGLE: little-endian signed bytes in the pickle */
        Rec **items;              /* V_TUPLE */
        PyObject *obj;            /* V_OBJ: the value, made (owned; static records': for good) */
        PyObject *buckets;        /* K_CONTAINER, K_OBJECT (never a value): {hash: set of keys} (owned), or NULL */
    } v;
};

#define MAX_TEXT_NAME 256
#define PLACEHOLDER_COST 512
#define MAX_TEXT_DIGITS 4300  /* Python's default int <-> str digit limit: the Python walk's bound */

/* records every walk shares (their values, made at import, live as long as the module) */
static Rec R_STR, R_BYTES, R_OTHER, R_LIST, R_EMPTY_TUPLE, R_NONE, R_TRUE, R_FALSE;
static Rec R_BYTE_INTS[256];
static PyObject *UNRESOLVED;  /* "<unresolved STACK_GLOBAL>" */
static PyObject *EMPTY_STR;
static PyObject *FROM_BYTES_KW;  /* {"signed": True} */
static PyObject *LITTLE;  /* "little" */
static PyObject *UNDERSCORES;  /* "__" */

/* ------------------------------------------------------------------------------------ the memo */

/* Indices below ``dcap`` live in a dense array; indices far past the entries stored (a hostile
   pickle's sparse ones) in an open-addressing table, so that the memory is bounded by the entries,
   never by an index's size. */
typedef struct { uint64_t key; Rec *value; } Slot;  /* key: index + 1 (0: empty) */

typedef struct {
    Rec **dense;
    size_t dcap;
    Slot *sparse;
    size_t scap, scount;
    size_t count;  /* distinct indices stored: len(memo) */
} Memo;

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return x;
}

static Rec *sparse_get(const Memo *m, uint64_t index) {
    if (m->scount == 0) return NULL;
    size_t mask = m->scap - 1, at = (size_t)mix(index) & mask;
    for (;;) {
        const Slot *s = &m->sparse[at];
        if (s->key == 0) return NULL;
        if (s->key == index + 1) return s->value;
        at = (at + 1) & mask;
    }
}

/* 1: a new index, 0: replaced, -1: no memory */
static int sparse_put(Memo *m, uint64_t index, Rec *value) {
    if ((m->scount + 1) * 2 > m->scap) {
        size_t cap = m->scap ? m->scap * 2 : 64;
        Slot *table = PyMem_Calloc(cap, sizeof(Slot));
        if (table == NULL) return -1;
        for (size_t k = 0; k < m->scap; k++) {
            Slot *s = &m->sparse[k];
            if (s->key == 0) continue;
            size_t at = (size_t)mix(s->key - 1) & (cap - 1);
            while (table[at].key != 0) at = (at + 1) & (cap - 1);
            table[at] = *s;
        }
        PyMem_Free(m->sparse);
        m->sparse = table;
        m->scap = cap;
    }
    size_t mask = m->scap - 1, at = (size_t)mix(index) & mask;
    for (;;) {
        Slot *s = &m->sparse[at];
        if (s->key == 0) {
            s->key = index + 1;
            s->value = value;
            m->scount++;
            return 1;
        }
        if (s->key == index + 1) {
            s->value = value;
            return 0;
        }
        at = (at + 1) & mask;
    }
}

static inline Rec *memo_get(const Memo *m, uint64_t index) {
    if (index < m->dcap) return m->dense[index];
    return sparse_get(m, index);
}

/* Grow the dense array to ``cap`` slots, moving the sparse entries below it there. */
static int dense_grow(Memo *m, size_t cap) {
    Rec **dense = PyMem_Realloc(m->dense, cap * sizeof(Rec *));
    if (dense == NULL) return -1;
    memset(dense + m->dcap, 0, (cap - m->dcap) * sizeof(Rec *));
    m->dense = dense;
    m->dcap = cap;
    if (m->scount == 0) return 0;
    Slot *old = m->sparse;
    size_t old_cap = m->scap;
    m->sparse = NULL;
    m->scap = m->scount = 0;
    int status = 0;
    for (size_t k = 0; k < old_cap; k++) {
        if (old[k].key == 0) continue;
        uint64_t index = old[k].key - 1;
        if (index < cap) dense[index] = old[k].value;
        else if (status == 0 && sparse_put(m, index, old[k].value) < 0) status = -1;
    }
    PyMem_Free(old);
    return status;
}

static int memo_put(Memo *m, uint64_t index, Rec *value) {
    if (index >= m->dcap) {
        /* dense while its slots stay within a few times the entries stored: an index under twice the
           entries (and 4096) grows it, at least doubling it (so at most 4 slots an entry, and 8192) */
        uint64_t bound = 2 * (uint64_t)m->count + 4096;
        if (index < bound) {
            uint64_t cap = m->dcap ? 2 * (uint64_t)m->dcap : 1024;
            if (cap < index + 1) cap = index + 1;
            if (dense_grow(m, (size_t)cap) < 0) return -1;
        } else {
            int added = sparse_put(m, index, value);
            if (added < 0) return -1;
            m->count += (size_t)added;
            return 0;
        }
    }
    if (m->dense[index] == NULL) m->count++;
    m->dense[index] = value;
    return 0;
}

static void memo_free(Memo *m) {
    PyMem_Free(m->dense);
    PyMem_Free(m->sparse);
}

/* ----------------------------------------------------------------------------------- the walk */

#define CHUNK_RECS 2048
typedef struct Chunk { struct Chunk *next; size_t used; Rec recs[CHUNK_RECS]; } Chunk;
typedef struct Block { struct Block *next; size_t used, size; unsigned char bytes[]; } Block;
#define BLOCK_BYTES (64 * 1024)
#define OPAQUE_CACHE 4096

/* Tuples of up to 4 ints (a tensor's size and stride) share one record per value: an int tuple's
   identity is seen by nothing (its hash and equality are its ints'), as the Python walk's own
   one-step entries share theirs. At most half the slots are filled. */
#define INT_TUPLE_SLOTS 4096
#define INT_TUPLE_ITEMS 4
typedef struct { Rec *rec; uint32_t count; int64_t values[INT_TUPLE_ITEMS]; } IntTuple;

enum { G_OK = 0, G_TRUNCATED = 1, G_REFUSED = 2, G_ERROR = -1 };

typedef struct {
    const unsigned char *data;
    Py_ssize_t end, at;
    Rec **stack;
    Py_ssize_t top, scap;
    Py_ssize_t *marks;
    Py_ssize_t nmarks, mcap;
    Memo memo;
    Chunk *chunks;
    Block *blocks;
    Rec **opaque_tuples;  /* [2 * OPAQUE_CACHE]: the shared record of opaque tuples by (hashable, nodes) */
    IntTuple *int_tuples; /* [INT_TUPLE_SLOTS] */
    size_t int_tuple_count;
    int64_t ops, memory, hashing;
    uint64_t memo_top;  /* one past the highest memo index stored: the length of CPython's memo table */
    Py_ssize_t frame_end;  /* where the frame being read ends; 0 outside frames */
    int64_t max_memory, max_pickle, max_nodes, max_collisions, max_depth, max_globals;
    PyObject *torch_globals;
    PyObject *names;
    PyObject *nested;   /* the nested names getattr's arguments spell (tuple records borrow them), or NULL */
    PyObject *message;  /* the refusal */
    uint64_t counts[256];
} Walk;

static Rec *new_rec(Walk *w) {
    Chunk *c = w->chunks;
    if (c == NULL || c->used == CHUNK_RECS) {
        c = PyMem_Malloc(sizeof(Chunk));
        if (c == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        c->next = w->chunks;
        c->used = 0;
        w->chunks = c;
    }
    Rec *r = &c->recs[c->used++];
    memset(r, 0, sizeof(Rec));
    return r;
}

static void *new_bytes(Walk *w, size_t size) {
    size = (size + 15) & ~(size_t)15;
    Block *b = w->blocks;
    if (b == NULL || b->size - b->used < size) {
        size_t room = size > BLOCK_BYTES ? size : BLOCK_BYTES;
        if (room > PY_SSIZE_T_MAX - sizeof(Block)) {
            PyErr_NoMemory();
            return NULL;
        }
        b = PyMem_Malloc(sizeof(Block) + room);
        if (b == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        b->size = room;
        b->used = 0;
        if (w->blocks != NULL && size > BLOCK_BYTES) {  /* a large one: keep filling the current block */
            b->next = w->blocks->next;
            w->blocks->next = b;
        } else {
            b->next = w->blocks;
            w->blocks = b;
        }
    }
    void *p = b->bytes + b->used;
    b->used += size;
    return p;
}

static void walk_free(Walk *w) {
    for (Chunk *c = w->chunks; c != NULL;) {
        for (size_t k = 0; k < c->used; k++) {
            Rec *r = &c->recs[k];
            if (r->vkind == V_OBJ) Py_DECREF(r->v.obj);
            else if (r->kind == K_CONTAINER || r->kind == K_OBJECT) Py_XDECREF(r->v.buckets);
        }
        Chunk *next = c->next;
        PyMem_Free(c);
        c = next;
    }
    for (Block *b = w->blocks; b != NULL;) {
        Block *next = b->next;
        PyMem_Free(b);
        b = next;
    }
    PyMem_Free(w->stack);
    PyMem_Free(w->marks);
    PyMem_Free(w->opaque_tuples);
    PyMem_Free(w->int_tuples);
    memo_free(&w->memo);
    Py_XDECREF(w->nested);
    Py_XDECREF(w->message);
}

#define FENCE(w) ((w)->nmarks ? (w)->marks[(w)->nmarks - 1] : 0)
#define HAS(w, n) ((w)->top - (n) >= FENCE(w))

static int refuse(Walk *w, PyObject *message) {
    if (message == NULL) return G_ERROR;
    Py_XSETREF(w->message, message);
    return G_REFUSED;
}
#define REFUSE(...) return refuse(w, PyUnicode_FromFormat(__VA_ARGS__))

static int push(Walk *w, Rec *r) {
    if (w->top == w->scap) {
        Py_ssize_t cap = w->scap ? w->scap * 2 : 256;
        Rec **stack = PyMem_Realloc(w->stack, (size_t)cap * sizeof(Rec *));
        if (stack == NULL) {
            PyErr_NoMemory();
            return G_ERROR;
        }
        w->stack = stack;
        w->scap = cap;
    }
    w->stack[w->top++] = r;
    return G_OK;
}
#define PUSH(r) do { Rec *pushed_ = (r); if (pushed_ == NULL || push(w, pushed_) < 0) return G_ERROR; } while (0)
#define TRY(call) do { int status_ = (call); if (status_ != G_OK) return status_; } while (0)

/* The values above the last MARK, taken off the stack (still readable until the next push). */
static int pop_mark(Walk *w, Rec ***items, Py_ssize_t *count) {
    if (w->nmarks == 0) REFUSE("has no MARK where one is needed (corrupt)");
    Py_ssize_t index = w->marks[--w->nmarks];
    if (index > w->top) index = w->top;  /* never: the stack does not go below its fence */
    *items = w->stack + index;
    *count = w->top - index;
    w->top = index;
    return G_OK;
}

/* i + size > limit, for a position, a length read from the pickle (up to 2**64 - 1) and a limit */
static inline int past(Py_ssize_t i, uint64_t size, int64_t limit) {
    if (limit < 0 || (int64_t)i > limit) return 1;
    return size > (uint64_t)(limit - (int64_t)i);
}

/* The text argument at ``at`` (up to its newline); moves ``at`` past the newline. */
static int line(Walk *w, const unsigned char **raw, Py_ssize_t *len) {
    const unsigned char *start = w->data + w->at;
    const unsigned char *nl = memchr(start, '\n', (size_t)(w->end - w->at));
    if (nl == NULL) return G_TRUNCATED;
    *raw = start;
    *len = nl - start;
    w->at += *len + 1;
    return G_OK;
}

static PyObject *repr_prefix(const unsigned char *raw, Py_ssize_t len) {  /* repr(raw[:20]) */
    PyObject *b = PyBytes_FromStringAndSize((const char *)raw, len < 20 ? len : 20);
    if (b == NULL) return NULL;
    PyObject *r = PyObject_Repr(b);
    Py_DECREF(b);
    return r;
}

static int all_digits(const unsigned char *raw, Py_ssize_t len) {
    if (len == 0) return 0;
    for (Py_ssize_t k = 0; k < len; k++)
        if (raw[k] < '0' || raw[k] > '9') return 0;
    return 1;
}

/* int(raw) for a text memo index (digits only): into *small when it fits 63 bits, else a Python int in *big */
static int text_index(const unsigned char *raw, Py_ssize_t len, int64_t *small, PyObject **big) {
    *big = NULL;
    if (len <= 18) {
        int64_t value = 0;
        for (Py_ssize_t k = 0; k < len; k++) value = value * 10 + (raw[k] - '0');
        *small = value;
        return G_OK;
    }
    char *text = PyMem_Malloc((size_t)len + 1);
    if (text == NULL) {
        PyErr_NoMemory();
        return G_ERROR;
    }
    memcpy(text, raw, (size_t)len);
    text[len] = 0;
    PyObject *value = PyLong_FromString(text, NULL, 10);  /* as int(raw): its digit limit included */
    PyMem_Free(text);
    if (value == NULL) return G_ERROR;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        Py_DECREF(value);
        return G_ERROR;
    }
    if (overflow) {
        *big = value;
        return G_OK;
    }
    Py_DECREF(value);
    *small = v;
    return G_OK;
}

static Rec *text_rec(Walk *w, const unsigned char *raw, Py_ssize_t len) {  /* _text(raw) */
    if (len > MAX_TEXT_NAME) return &R_STR;
    Rec *r = new_rec(w);
    if (r == NULL) return NULL;
    r->kind = K_STR;
    r->hashable = 1;
    r->nodes = 1;
    r->n.sname = raw;
    r->len = (uint32_t)len;
    return r;
}

static Rec *int_rec(Walk *w, int64_t value) {
    if (value >= 0 && value < 256) {
        /* a fresh record in the Python walk, alike in all but identity, which no int's hash or equality sees */
        return &R_BYTE_INTS[value];
    }
    Rec *r = new_rec(w);
    if (r == NULL) return NULL;
    r->kind = K_LITERAL;
    r->hashable = 1;
    r->nodes = 1;
    r->vkind = V_INT;
    r->v.i = value;
    return r;
}

static Rec *obj_rec(Walk *w, PyObject *value) {  /* a literal whose value is made already (steals it) */
    Rec *r = new_rec(w);
    if (r == NULL) {
        Py_DECREF(value);
        return NULL;
    }
    r->kind = K_LITERAL;
    r->hashable = 1;
    r->nodes = 1;
    r->vkind = V_OBJ;
    r->v.obj = value;
    return r;
}

static Rec *receiver(Walk *w, int kind, PyObject *name, uint8_t flags, int hashable) {
    Rec *r = new_rec(w);
    if (r == NULL) return NULL;
    r->kind = (uint8_t)kind;
    r->n.gname = name;
    r->flags = flags;
    r->hashable = (uint8_t)hashable;
    r->nodes = 1;
    return r;
}

static int name_flags(Walk *w, PyObject *name, uint8_t *flags) {
    int in = PySequence_Contains(w->torch_globals, name);
    if (in < 0) return G_ERROR;
    *flags = N_KNOWN | (in ? N_TORCH : 0);
    if (PyUnicode_CompareWithASCIIString(name, "_codecs.encode") == 0 ||
        PyUnicode_CompareWithASCIIString(name, "builtins.complex") == 0 ||
        PyUnicode_CompareWithASCIIString(name, "__builtin__.complex") == 0)
        *flags |= N_VALUE;
    if (PyUnicode_CompareWithASCIIString(name, "collections.OrderedDict") == 0) *flags |= N_ODICT;
    return G_OK;
}

/* _made_by: the record of an object a callable builds (REDUCE, NEWOBJ, OBJ) */
static Rec *made_by(Walk *w, Rec *callable) {
    PyObject *name = callable->kind == K_GLOBAL ? callable->n.gname : NULL;
    int hashable = 0;
    uint8_t flags = 0;
    if (name != NULL) {
        if (!(callable->flags & N_KNOWN)) {
            if (name_flags(w, name, &callable->flags) < 0) return NULL;
        }
        flags = callable->flags;
        hashable = (flags & N_VALUE) || !(flags & N_TORCH);
    }
    return receiver(w, K_OBJECT, name, flags, hashable);
}

/* How deep tuples nest in a record: what comparing two equal ones recurses (0 but for tuples). The Python
   walk's ``depth``, held in a tuple record's ``flags`` (capped: the walk runs in C only while MAX_NESTING is
   below the cap) */
#define MAX_DEPTH 255
static inline int depth_of(const Rec *r) {
    return r->kind == K_TUPLE ? (r->flags ? r->flags : 1) : 0;
}

/* a new record of a tuple whose values the guard cannot all know */
static Rec *tuple_rec(Walk *w, int64_t nodes, int hashable, int depth) {
    Rec *r = new_rec(w);
    if (r == NULL) return NULL;
    r->kind = K_TUPLE;
    r->nodes = nodes;
    r->hashable = (uint8_t)hashable;
    r->flags = (uint8_t)depth;
    return r;
}

/* the shared record of tuples of ``nodes`` values nesting ``depth`` deep that the guard cannot all know;
   cached for the shallow ones (all real pickles' tuples) */
#define OPAQUE_DEPTHS 4
static Rec *opaque_tuple(Walk *w, int64_t nodes, int hashable, int depth) {
    Rec **slot = NULL;
    if (nodes >= 0 && nodes < OPAQUE_CACHE && depth < OPAQUE_DEPTHS) {
        if (w->opaque_tuples == NULL) {
            w->opaque_tuples = PyMem_Calloc(2 * OPAQUE_DEPTHS * OPAQUE_CACHE, sizeof(Rec *));
            if (w->opaque_tuples == NULL) {
                PyErr_NoMemory();
                return NULL;
            }
        }
        slot = &w->opaque_tuples[((hashable ? OPAQUE_DEPTHS : 0) + depth) * OPAQUE_CACHE + nodes];
        if (*slot != NULL) return *slot;
    }
    Rec *r = tuple_rec(w, nodes, hashable, depth);
    if (r != NULL && slot != NULL) *slot = r;
    return r;
}

static inline int int_value(const Rec *r, int64_t *value) {
    if ((uintptr_t)r >= (uintptr_t)R_BYTE_INTS && (uintptr_t)r < (uintptr_t)(R_BYTE_INTS + 256)) {
        *value = r - R_BYTE_INTS;
        return 1;
    }
    if (r->vkind == V_INT) {
        *value = r->v.i;
        return 1;
    }
    return 0;
}

/* The slot of the int tuple ``items`` (empty, or holding it), or NULL when they are not all ints. */
static IntTuple *int_tuple_slot(Walk *w, Rec **items, Py_ssize_t count, int64_t *values) {
    if (count > INT_TUPLE_ITEMS) return NULL;
    uint64_t h = (uint64_t)count;
    for (Py_ssize_t k = 0; k < count; k++) {
        if (!int_value(items[k], &values[k])) return NULL;
        h = mix(h ^ (uint64_t)values[k]) + (uint64_t)k;
    }
    if (w->int_tuples == NULL) {
        w->int_tuples = PyMem_Calloc(INT_TUPLE_SLOTS, sizeof(IntTuple));
        if (w->int_tuples == NULL) return NULL;  /* not shared, then */
    }
    size_t at = (size_t)h & (INT_TUPLE_SLOTS - 1);
    for (;;) {
        IntTuple *slot = &w->int_tuples[at];
        if (slot->rec == NULL) return slot;
        if (slot->count == (uint32_t)count && memcmp(slot->values, values, (size_t)count * sizeof(int64_t)) == 0)
            return slot;
        at = (at + 1) & (INT_TUPLE_SLOTS - 1);
    }
}

static int global_name(Walk *w, Rec *r, PyObject **decoded);

/* _attribute_pair: "<global>.<name>" when the items are a global and a plain identifier, no dunder (getattr's
   arguments spelling a nested name), kept alive by the walk; NULL (no error) when they are not */
static int attribute_pair(Walk *w, Rec **items, PyObject **nested) {
    *nested = NULL;
    Rec *parent = items[0], *attribute = items[1];
    if (parent->kind != K_GLOBAL || parent->n.gname == NULL || attribute->kind != K_STR) return G_OK;
    PyObject *text;
    if (global_name(w, attribute, &text) != G_OK) return G_ERROR;
    if (text == NULL) return G_OK;
    int plain = PyUnicode_IsIdentifier(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    if (plain && PyUnicode_Tailmatch(text, UNDERSCORES, 0, n, -1) == 1 && PyUnicode_Tailmatch(text, UNDERSCORES, 0, n, 1) == 1)
        plain = 0;
    if (plain <= 0 || PyErr_Occurred()) {
        Py_DECREF(text);
        return PyErr_Occurred() ? G_ERROR : G_OK;
    }
    PyObject *full = PyUnicode_FromFormat("%U.%U", parent->n.gname, text);
    Py_DECREF(text);
    if (full == NULL) return G_ERROR;
    if (w->nested == NULL && (w->nested = PyList_New(0)) == NULL) {
        Py_DECREF(full);
        return G_ERROR;
    }
    int appended = PyList_Append(w->nested, full);
    Py_DECREF(full);
    if (appended < 0) return G_ERROR;
    *nested = full;  /* the list holds it */
    return G_OK;
}

/* _new_tuple (``count`` > 0) */
static Rec *new_tuple(Walk *w, Rec **items, Py_ssize_t count) {
    int64_t nodes = 1, cap = w->max_nodes + 1;
    int hashable = 1, predictable = 1, depth = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        Rec *item = items[k];
        if (nodes <= cap) nodes += item->nodes;  /* past cap it is cap + 1 either way */
        int item_depth = depth_of(item);
        if (item_depth > depth) depth = item_depth;
        if (!item->hashable) hashable = 0;
        else if (item->vkind == V_OPAQUE) predictable = 0;
    }
    if (nodes > w->max_nodes) nodes = cap;
    depth = depth < MAX_DEPTH ? depth + 1 : MAX_DEPTH;
    if (!(predictable && hashable)) {
        PyObject *nested = NULL;
        if (count == 2 && attribute_pair(w, items, &nested) != G_OK) return NULL;
        if (nested != NULL) {  /* a tuple like any other, knowing the name getattr would make of it */
            Rec *r = tuple_rec(w, nodes, hashable, depth);
            if (r != NULL) r->n.gname = nested;
            return r;
        }
        return opaque_tuple(w, nodes, hashable, depth);
    }
    int64_t values[INT_TUPLE_ITEMS];
    IntTuple *slot = int_tuple_slot(w, items, count, values);
    if (slot != NULL && slot->rec != NULL) return slot->rec;
    if ((size_t)count > UINT32_MAX) {  /* never: a tuple of 4 billion items is a 4 GB pickle at least */
        PyErr_SetString(PyExc_OverflowError, "tuple too long");
        return NULL;
    }
    Rec **copy = new_bytes(w, (size_t)count * sizeof(Rec *));
    if (copy == NULL) return NULL;
    memcpy(copy, items, (size_t)count * sizeof(Rec *));
    Rec *r = new_rec(w);
    if (r == NULL) return NULL;
    r->kind = K_TUPLE;
    r->hashable = 1;
    r->nodes = nodes;
    r->flags = (uint8_t)depth;
    r->vkind = V_TUPLE;
    r->v.items = copy;
    r->len = (uint32_t)count;
    if (slot != NULL && w->int_tuple_count < INT_TUPLE_SLOTS / 2) {
        slot->rec = r;
        slot->count = (uint32_t)count;
        memcpy(slot->values, values, (size_t)count * sizeof(int64_t));
        w->int_tuple_count++;
    }
    return r;
}

/* The value of a record that has one, as a Python object (borrowed: the record keeps it, as V_OBJ).
   Tuples are made from their items' objects, so a record's value is one object however often it is
   used (as the Python walk's values are: a NaN read once is the same object wherever it goes).
   Nesting is walked with a stack of our own, not by recursion. */
static PyObject *make_leaf(Rec *r) {
    PyObject *made = NULL;
    switch (r->vkind) {
    case V_OBJ: return r->v.obj;
    case V_INT: made = PyLong_FromLongLong(r->v.i); break;
    case V_FLOAT: made = PyFloat_FromDouble(r->v.f); break;
    case V_BIGLE: {  /* int.from_bytes(raw, "little", signed=True) */
        PyObject *raw = PyBytes_FromStringAndSize((const char *)r->v.p, (Py_ssize_t)r->len);
        if (raw == NULL) return NULL;
        PyObject *args = PyTuple_Pack(2, raw, LITTLE);
        Py_DECREF(raw);
        if (args == NULL) return NULL;
        PyObject *from_bytes = PyObject_GetAttrString((PyObject *)&PyLong_Type, "from_bytes");
        if (from_bytes != NULL) {
            made = PyObject_Call(from_bytes, args, FROM_BYTES_KW);
            Py_DECREF(from_bytes);
        }
        Py_DECREF(args);
        break;
    }
    default: PyErr_SetString(PyExc_SystemError, "a guard record without a value"); return NULL;
    }
    if (made == NULL) return NULL;
    r->v.obj = made;
    r->vkind = V_OBJ;
    return made;
}

static PyObject *make_value(Rec *root) {
    if (root->vkind != V_TUPLE) return make_leaf(root);
    size_t cap = 64, depth = 0;
    Rec **path = PyMem_Malloc(cap * sizeof(Rec *));
    uint32_t *next = PyMem_Malloc(cap * sizeof(uint32_t));
    if (path == NULL || next == NULL) goto nomemory;
    path[0] = root;
    next[0] = 0;
    depth = 1;
    while (depth) {
        Rec *t = path[depth - 1];
        uint32_t k = next[depth - 1];
        while (k < t->len) {
            Rec *item = t->v.items[k];
            if (item->vkind != V_OBJ) {
                if (item->vkind == V_TUPLE) break;
                if (make_leaf(item) == NULL) goto error;
            }
            k++;
        }
        next[depth - 1] = k;
        if (k < t->len) {  /* a nested tuple not yet made: make it first */
            if (depth == cap) {
                cap *= 2;
                Rec **p = PyMem_Realloc(path, cap * sizeof(Rec *));
                if (p == NULL) goto nomemory;
                path = p;
                uint32_t *n = PyMem_Realloc(next, cap * sizeof(uint32_t));
                if (n == NULL) goto nomemory;
                next = n;
            }
            path[depth] = t->v.items[k];
            next[depth] = 0;
            depth++;
            continue;
        }
        PyObject *tuple = PyTuple_New((Py_ssize_t)t->len);
        if (tuple == NULL) goto error;
        for (uint32_t j = 0; j < t->len; j++) {
            PyObject *item = t->v.items[j]->v.obj;
            Py_INCREF(item);
            PyTuple_SET_ITEM(tuple, j, item);
        }
        t->v.obj = tuple;
        t->vkind = V_OBJ;
        depth--;
    }
    PyMem_Free(path);
    PyMem_Free(next);
    return root->v.obj;
nomemory:
    PyErr_NoMemory();
error:
    PyMem_Free(path);
    PyMem_Free(next);
    return NULL;
}

/* ``{x.name or ''}`` in a message */
static PyObject *name_text(Rec *r) {
    if (r->kind == K_STR && r->n.sname != NULL && r->len > 0) {
        PyObject *b = PyBytes_FromStringAndSize((const char *)r->n.sname, (Py_ssize_t)r->len);
        if (b == NULL) return NULL;
        PyObject *s = PyObject_Repr(b);
        Py_DECREF(b);
        return s;
    }
    if ((r->kind == K_GLOBAL || r->kind == K_OBJECT) && r->n.gname != NULL && PyUnicode_GET_LENGTH(r->n.gname) > 0) {
        Py_INCREF(r->n.gname);
        return r->n.gname;
    }
    return NULL;
}

/* add_keys: keys (``count`` of them, every ``step``-th of ``keys``) going into ``target`` */
static int add_keys(Walk *w, Rec *target, Rec **keys, Py_ssize_t count, Py_ssize_t step) {
    if (target->kind != K_CONTAINER && target->kind != K_OBJECT)
        REFUSE("adds items to a %s, which holds none (corrupt)", KIND_NAMES[target->kind]);
    for (Py_ssize_t k = 0; k < count; k++) {
        Rec *key = keys[k * step];
        if (!key->hashable) {
            PyObject *name = name_text(key);
            if (name == NULL && PyErr_Occurred()) return G_ERROR;
            PyObject *message = PyUnicode_FromFormat("uses a %s %U as a dict key or set element",
                                                     KIND_NAMES[key->kind], name != NULL ? name : EMPTY_STR);
            Py_XDECREF(name);
            return refuse(w, message);
        }
        if (key->nodes > w->max_nodes)
            REFUSE("uses a dict key or set element of %lld+ nested values (a hashing bomb)", (long long)key->nodes);
        if (depth_of(key) > w->max_depth)  /* comparing two equal ones would recurse that deep */
            REFUSE("uses a dict key or set element nested over %lld levels deep (a hashing bomb)",
                   (long long)w->max_depth);
        w->hashing = key->nodes > INT64_MAX - w->hashing ? INT64_MAX : w->hashing + key->nodes;
        if (key->vkind == V_OPAQUE) continue;
        PyObject *value = make_value(key);
        if (value == NULL) return G_ERROR;
        Py_hash_t hash = PyObject_Hash(value);
        if (hash == -1 && PyErr_Occurred()) return G_ERROR;
        if (target->v.buckets == NULL && (target->v.buckets = PyDict_New()) == NULL) return G_ERROR;
        PyObject *h = PyLong_FromSsize_t(hash);
        if (h == NULL) return G_ERROR;
        PyObject *bucket = PyDict_GetItemWithError(target->v.buckets, h);
        if (bucket == NULL) {
            if (PyErr_Occurred() || (bucket = PySet_New(NULL)) == NULL) {
                Py_DECREF(h);
                return G_ERROR;
            }
            int stored = PyDict_SetItem(target->v.buckets, h, bucket);
            Py_DECREF(bucket);  /* the dict holds it */
            if (stored < 0) {
                Py_DECREF(h);
                return G_ERROR;
            }
        }
        Py_DECREF(h);
        if (PySet_Add(bucket, value) < 0) return G_ERROR;
        Py_ssize_t size = PySet_GET_SIZE(bucket);
        if ((int64_t)size > w->max_collisions)
            REFUSE("puts %zd distinct keys with one hash into a dict or set (a hash-collision flood)", size);
    }
    if (w->hashing > 8 * w->ops + 100000) REFUSE("hashes more nested keys than its size allows (a hashing bomb)");
    return G_OK;
}

/* counted: a length of ``width`` bytes at the position, checked against the bytes that follow it.
   As int.from_bytes over data[at:at + width]: a slice cut short by the end reads fewer bytes. */
static int counted(Walk *w, int width, int is_signed, uint64_t *size) {
    Py_ssize_t avail = w->end - w->at, n = avail < width ? (avail < 0 ? 0 : avail) : width;
    const unsigned char *p = w->data + w->at;
    uint64_t value = 0;
    for (Py_ssize_t k = n - 1; k >= 0; k--) value = (value << 8) | p[k];
    w->at += width;
    if (is_signed && n > 0 && (p[n - 1] & 0x80)) {  /* widths here are at most 4 bytes when signed */
        int64_t negative = (int64_t)value - ((int64_t)1 << (8 * n));
        REFUSE("has a negative length %lld at offset %zd (corrupt)", (long long)negative, w->at - width);
    }
    if (past(w->at, value, w->max_pickle))
        REFUSE("has a %llu-byte value, over the %lld-byte pickle limit", (unsigned long long)value,
               (long long)w->max_pickle);
    if (past(w->at, value, w->end)) return G_TRUNCATED;
    *size = value;
    return G_OK;
}

static int global_name(Walk *w, Rec *r, PyObject **decoded) {  /* _text_name(r.name) for a "str" record */
    *decoded = NULL;
    if (r->kind != K_STR || r->n.sname == NULL) return G_OK;
    *decoded = PyUnicode_DecodeUTF8((const char *)r->n.sname, (Py_ssize_t)r->len, "strict");
    if (*decoded == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) return G_ERROR;
        PyErr_Clear();
    }
    return G_OK;
}

static int add_name(Walk *w, PyObject *name) {  /* each becomes a placeholder class when unpickled */
    if ((int64_t)PyList_GET_SIZE(w->names) >= w->max_globals)
        REFUSE("names over %lld globals (a memory bomb)", (long long)w->max_globals);
    return PyList_Append(w->names, name) < 0 ? G_ERROR : G_OK;
}

/* ------------------------------------------------------------------------------ the rare opcodes */

static int op_rare(Walk *w, unsigned code) {
    const unsigned char *raw;
    Py_ssize_t len;
    Rec **items;
    Py_ssize_t count;
    uint64_t size;
    switch (code) {
    case 0x8D: case 0x54: case 0x55: case 0x42: case 0x43: case 0x8E: case 0x96: {  /* sized */
        int width = code == 0x55 || code == 0x43 ? 1 : code == 0x54 || code == 0x42 ? 4 : 8;
        TRY(counted(w, width, code == 0x54, &size));
        raw = w->data + w->at;
        if (code == 0x8D || code == 0x54 || code == 0x55) PUSH(text_rec(w, raw, (Py_ssize_t)size));
        else if (code == 0x96) PUSH(receiver(w, K_CONTAINER, NULL, 0, 0));
        else PUSH(&R_BYTES);
        w->at += (Py_ssize_t)size;
        w->memory += 56 + (int64_t)size;
        return G_OK;
    }
    case 0x4D: case 0x4A: {  /* BININT2 BININT */
        int width = code == 0x4D ? 2 : 4;
        if (w->at + width > w->end) return G_TRUNCATED;
        const unsigned char *p = w->data + w->at;
        int64_t value = code == 0x4D ? (int64_t)(p[0] | (p[1] << 8))
                                     : (int64_t)(int32_t)((uint32_t)p[0] | ((uint32_t)p[1] << 8) |
                                                          ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24));
        PUSH(int_rec(w, value));
        w->at += width;
        w->memory += 40;
        return G_OK;
    }
    case 0x8A: case 0x8B: {  /* LONG1 LONG4 */
        TRY(counted(w, code == 0x8A ? 1 : 4, code == 0x8B, &size));
        const unsigned char *p = w->data + w->at;
        Rec *r;
        if (size <= 8) {
            uint64_t value = 0;
            for (int k = (int)size - 1; k >= 0; k--) value = (value << 8) | p[k];
            if (size > 0 && size < 8 && (p[size - 1] & 0x80)) value |= ~(uint64_t)0 << (8 * size);
            r = int_rec(w, (int64_t)value);
        } else {
            r = new_rec(w);
            if (r != NULL) {
                r->kind = K_LITERAL;
                r->hashable = 1;
                r->nodes = 1;
                r->vkind = V_BIGLE;
                r->v.p = p;
                r->len = (uint32_t)size;
            }
        }
        PUSH(r);
        w->at += (Py_ssize_t)size;
        w->memory += 32 + (int64_t)size;
        return G_OK;
    }
    case 0x47: {  /* BINFLOAT: big-endian IEEE 754, as struct.unpack(">d") */
        if (w->at + 8 > w->end) return G_TRUNCATED;
        const unsigned char *p = w->data + w->at;
        uint64_t bits = 0;
        for (int k = 0; k < 8; k++) bits = (bits << 8) | p[k];
        double value;
        memcpy(&value, &bits, 8);
        Rec *r = new_rec(w);
        if (r == NULL) return G_ERROR;
        r->kind = K_LITERAL;
        r->hashable = 1;
        r->nodes = 1;
        r->vkind = V_FLOAT;
        r->v.f = value;
        PUSH(r);
        w->at += 8;
        w->memory += 32;
        return G_OK;
    }
    case 0x49: case 0x4C: {  /* INT LONG (text) */
        TRY(line(w, &raw, &len));
        if (code == 0x4C && len > 0 && raw[len - 1] == 'L') len--;
        Rec *r;
        if (code == 0x49 && len == 2 && raw[0] == '0' && (raw[1] == '0' || raw[1] == '1')) {
            r = raw[1] == '1' ? &R_TRUE : &R_FALSE;
        } else {
            /* -?(0|[1-9][0-9]*), at most 4300 characters */
            Py_ssize_t k = len > 0 && raw[0] == '-' ? 1 : 0;
            int canonical = len - k >= 1 && all_digits(raw + k, len - k) && (raw[k] != '0' || len - k == 1) &&
                            len <= MAX_TEXT_DIGITS;
            if (!canonical) {
                PyObject *shown = repr_prefix(raw, len);
                if (shown == NULL) return G_ERROR;
                PyObject *message = PyUnicode_FromFormat(
                    "has an integer %U not written the way Python's pickler writes it", shown);
                Py_DECREF(shown);
                return refuse(w, message);
            }
            if (len - k <= 18) {
                int64_t value = 0;
                for (Py_ssize_t j = k; j < len; j++) value = value * 10 + (raw[j] - '0');
                r = int_rec(w, k ? -value : value);
            } else {  /* int(raw), its digit limit included */
                PyObject *text = PyBytes_FromStringAndSize((const char *)raw, len);
                if (text == NULL) return G_ERROR;
                PyObject *value = PyLong_FromString(PyBytes_AS_STRING(text), NULL, 10);
                Py_DECREF(text);
                if (value == NULL) return G_ERROR;
                r = obj_rec(w, value);
            }
        }
        PUSH(r);
        w->memory += 32 + len;
        return G_OK;
    }
    case 0x46: {  /* FLOAT (text): float(raw) */
        TRY(line(w, &raw, &len));
        PyObject *text = PyBytes_FromStringAndSize((const char *)raw, len);
        if (text == NULL) return G_ERROR;
        PyObject *value = PyFloat_FromString(text);
        Py_DECREF(text);
        if (value == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_ValueError)) return G_ERROR;
            PyErr_Clear();
            PyObject *shown = repr_prefix(raw, len);
            if (shown == NULL) return G_ERROR;
            PyObject *message = PyUnicode_FromFormat("has a malformed float %U", shown);
            Py_DECREF(shown);
            return refuse(w, message);
        }
        PUSH(obj_rec(w, value));
        w->memory += 32;
        return G_OK;
    }
    case 0x53: case 0x56: {  /* STRING UNICODE (text) */
        TRY(line(w, &raw, &len));
        /* the text the unpickler makes is these bytes only when they are ASCII with no escape (UNICODE
           decodes raw-unicode-escape, byte by byte: UTF-8 bytes are not the name they spell) */
        int plain = 1;
        for (Py_ssize_t k = 0; k < len; k++)
            if (raw[k] == '\\' || raw[k] >= 0x80) { plain = 0; break; }
        if (code == 0x53) {
            int quoted = len >= 2 && raw[0] == raw[len - 1] && (raw[0] == '\'' || raw[0] == '"');
            PUSH(quoted && plain ? text_rec(w, raw + 1, len - 2) : &R_STR);
        } else {
            PUSH(plain ? text_rec(w, raw, len) : &R_STR);
        }
        w->memory += 56 + len;
        return G_OK;
    }
    case 0x63: case 0x69: {  /* GLOBAL INST */
        const unsigned char *module, *attribute;
        Py_ssize_t module_len, attribute_len;
        TRY(line(w, &module, &module_len));
        TRY(line(w, &attribute, &attribute_len));
        PyObject *m = PyUnicode_DecodeUTF8((const char *)module, module_len, "strict");
        PyObject *a = m == NULL ? NULL : PyUnicode_DecodeUTF8((const char *)attribute, attribute_len, "strict");
        if (a == NULL) {
            Py_XDECREF(m);
            if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) return G_ERROR;
            PyErr_Clear();
            REFUSE("names a global that is not UTF-8");
        }
        PyObject *full = PyUnicode_FromFormat("%U.%U", m, a);
        Py_DECREF(m);
        Py_DECREF(a);
        if (full == NULL) return G_ERROR;
        int added = add_name(w, full);
        Py_DECREF(full);  /* the names list holds it, and records borrow it from there */
        if (added != G_OK) return added;
        if (code == 0x69) {
            TRY(pop_mark(w, &items, &count));
            uint8_t flags;
            if (name_flags(w, full, &flags) < 0) return G_ERROR;
            PUSH(receiver(w, K_OBJECT, full, flags, !(flags & N_TORCH)));
            w->memory += PLACEHOLDER_COST;
        } else {
            Rec *r = new_rec(w);
            if (r == NULL) return G_ERROR;
            r->kind = K_GLOBAL;
            r->hashable = 1;
            r->nodes = 1;
            r->n.gname = full;
            PUSH(r);
        }
        return G_OK;
    }
    case 0x93: {  /* STACK_GLOBAL */
        if (!HAS(w, 2)) REFUSE("has STACK_GLOBAL without a module and name (corrupt)");
        Rec *module = w->stack[w->top - 2], *attribute = w->stack[w->top - 1];
        w->top -= 2;
        PyObject *m, *a, *full = NULL;
        TRY(global_name(w, module, &m));
        if (global_name(w, attribute, &a) < 0) {
            Py_XDECREF(m);
            return G_ERROR;
        }
        if (m != NULL && a != NULL) {
            full = PyUnicode_FromFormat("%U.%U", m, a);
            if (full == NULL) {
                Py_DECREF(m);
                Py_DECREF(a);
                return G_ERROR;
            }
        }
        Py_XDECREF(m);
        Py_XDECREF(a);
        int added = add_name(w, full != NULL ? full : UNRESOLVED);
        Py_XDECREF(full);
        if (added != G_OK) return added;
        Rec *r = new_rec(w);
        if (r == NULL) return G_ERROR;
        r->kind = K_GLOBAL;
        r->hashable = 1;
        r->nodes = 1;
        r->n.gname = full;  /* borrowed from the names list */
        PUSH(r);
        return G_OK;
    }
    case 0x82: case 0x83: case 0x84:  /* EXT1 EXT2 EXT4: refused (the Python walk's ext says why) */
        w->at += code == 0x82 ? 1 : code == 0x83 ? 2 : 4;
        if (w->at > w->end) return G_TRUNCATED;
        REFUSE("uses an extension code (EXT1, EXT2, EXT4): the global it names is the loading process's copyreg "
               "registry's, not the file's, and the unpickler caches it across reads (torch's loader refuses it too)");
    case 0x6F:  /* OBJ */
        TRY(pop_mark(w, &items, &count));
        if (count == 0) REFUSE("has OBJ without a class (corrupt)");
        PUSH(made_by(w, items[0]));
        w->memory += PLACEHOLDER_COST;
        return G_OK;
    case 0x50:  /* PERSID (text) */
        TRY(line(w, &raw, &len));
        PUSH(&R_OTHER);
        w->memory += PLACEHOLDER_COST;
        return G_OK;
    case 0x62: {  /* BUILD */
        if (!HAS(w, 2)) REFUSE("sets state with too few values on its stack (corrupt)");
        w->top--;
        Rec *target = w->stack[w->top - 1];
        if (target->kind == K_OBJECT && target->n.gname != NULL) {
            if (!(target->flags & N_KNOWN) && name_flags(w, target->n.gname, &target->flags) < 0) return G_ERROR;
            if (!(target->flags & N_TORCH) || (target->flags & N_ODICT)) {
                w->memory += 64;
                return G_OK;
            }
        }
        PyObject *name = name_text(target);
        if (name == NULL) {
            if (PyErr_Occurred()) return G_ERROR;
            REFUSE("sets state (BUILD) on a %s, which torch's loader never does", KIND_NAMES[target->kind]);
        }
        PyObject *message = PyUnicode_FromFormat("sets state (BUILD) on %U, which torch's loader never does", name);
        Py_DECREF(name);
        return refuse(w, message);
    }
    case 0x5D:  /* EMPTY_LIST */
        PUSH(&R_LIST);
        w->memory += 88;
        return G_OK;
    case 0x7D: case 0x8F:  /* EMPTY_DICT EMPTY_SET */
        PUSH(receiver(w, K_CONTAINER, NULL, 0, 0));
        w->memory += code == 0x8F ? 360 : 240;
        return G_OK;
    case 0x64: case 0x91: case 0x6C: {  /* DICT FROZENSET LIST */
        TRY(pop_mark(w, &items, &count));
        Rec *container = code == 0x6C ? &R_LIST : receiver(w, K_CONTAINER, NULL, 0, 0);
        if (container == NULL) return G_ERROR;
        if (code == 0x64) {
            if (count % 2) REFUSE("has an odd number of items for DICT (corrupt)");
            TRY(add_keys(w, container, items, count / 2, 2));
        } else if (code == 0x91) {
            TRY(add_keys(w, container, items, count, 1));
        }
        PUSH(container);
        w->memory += 216 + 100 * (int64_t)count;
        return G_OK;
    }
    case 0x75: case 0x73: case 0x90: {  /* SETITEMS SETITEM ADDITEMS */
        Py_ssize_t keys, step;
        if (code == 0x73) {
            if (!HAS(w, 2)) REFUSE("has SETITEM without a key and value (corrupt)");
            items = w->stack + w->top - 2;
            keys = step = 1;
            w->top -= 2;
        } else {
            TRY(pop_mark(w, &items, &count));
            if (code == 0x75 && count % 2) REFUSE("has an odd number of items for SETITEMS (corrupt)");
            keys = code == 0x75 ? count / 2 : count;
            step = code == 0x75 ? 2 : 1;
        }
        if (!HAS(w, 1)) REFUSE("adds items with no dict or set below them (corrupt)");
        TRY(add_keys(w, w->stack[w->top - 1], items, keys, step));
        w->memory += 100 * (int64_t)keys;
        return G_OK;
    }
    case 0x61:  /* APPEND */
        if (!HAS(w, 2)) REFUSE("has APPEND without a list (corrupt)");
        w->top--;
        w->memory += 16;
        return G_OK;
    case 0x65:  /* APPENDS */
        TRY(pop_mark(w, &items, &count));
        w->memory += 16 * (int64_t)count;
        if (!HAS(w, 1)) REFUSE("has APPENDS without a list (corrupt)");
        return G_OK;
    case 0x30:  /* POP: the top value, or a MARK with nothing above it */
        if (w->nmarks && w->marks[w->nmarks - 1] == w->top) w->nmarks--;
        else if (!HAS(w, 1)) REFUSE("pops below its stack (corrupt)");
        else w->top--;
        return G_OK;
    case 0x31:  /* POP_MARK */
        return pop_mark(w, &items, &count);
    case 0x32:  /* DUP */
        if (!HAS(w, 1)) REFUSE("has DUP on an empty stack (corrupt)");
        PUSH(w->stack[w->top - 1]);
        w->memory += 8;
        return G_OK;
    case 0x80:  /* PROTO */
        w->at += 1;
        if (w->at > w->end) return G_TRUNCATED;
        return G_OK;
    case 0x95: {  /* FRAME: the reader takes the frame's bytes in one read and serves the opcodes from them */
        if (w->frame_end)
            REFUSE("starts a frame at offset %zd inside the frame that ends at offset %zd", w->at - 1, w->frame_end);
        if (w->at + 8 > w->end) return G_TRUNCATED;
        const unsigned char *p = w->data + w->at;
        uint64_t size = 0;
        for (int k = 7; k >= 0; k--) size = (size << 8) | p[k];
        w->at += 8;
        if (past(w->at, size, w->end)) {
            if (past(w->at, size, w->max_pickle))
                REFUSE("has a %llu-byte frame, over the %lld-byte pickle limit", (unsigned long long)size,
                       (long long)w->max_pickle);
            return G_TRUNCATED;
        }
        w->frame_end = w->at + (Py_ssize_t)size;
        return G_OK;
    }
    case 0x98:  /* READONLY_BUFFER */
        if (!HAS(w, 1)) REFUSE("has READONLY_BUFFER on an empty stack (corrupt)");
        return G_OK;
    default: {  /* NEXT_BUFFER (out-of-band data a file cannot carry), or no opcode */
        char hex[8];
        PyOS_snprintf(hex, sizeof hex, "%02x", code);
        REFUSE("has byte 0x%s at offset %zd, which is not an opcode ckptool reads", hex, w->at - 1);
    }
    }
}

/* ------------------------------------------------------------------------------- the main loop */

static int run(Walk *w) {
    const unsigned char *data = w->data;
    const Py_ssize_t end = w->end;
    const unsigned char *raw;
    Py_ssize_t len;
    for (;;) {
        if (w->frame_end && w->at >= w->frame_end) {
            /* an argument read past the frame's end: a file reader takes it from the bytes after the frame,
               dropping the frame's rest; a bytes reader reads on; the Python unpickler refuses */
            if (w->at > w->frame_end)
                REFUSE("has an opcode that runs past the end of its frame at offset %zd, so unpicklers would read "
                       "different opcodes from it (a disguise)", w->frame_end);
            w->frame_end = 0;
        }
        if ((w->ops & 0xFFFFF) == 0xFFFFF && PyErr_CheckSignals() < 0) return G_ERROR;  /* Ctrl-C, SIGTERM */
        if (w->at >= end) return G_TRUNCATED;
        unsigned code = data[w->at++];
        w->ops++;
        w->counts[code]++;
        switch (code) {
        case 0x72: case 0x71: case 0x94: case 0x70: {  /* LONG_BINPUT BINPUT MEMOIZE PUT */
            uint64_t index;
            if (code == 0x72) {
                if (w->at + 4 > end) return G_TRUNCATED;
                const unsigned char *p = data + w->at;
                index = (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) | ((uint64_t)p[3] << 24);
                w->at += 4;
            } else if (code == 0x71) {
                if (w->at >= end) return G_TRUNCATED;
                index = data[w->at++];
            } else if (code == 0x94) {
                index = w->memo.count;
            } else {
                TRY(line(w, &raw, &len));
                if (!all_digits(raw, len) || len > MAX_TEXT_DIGITS) {
                    PyObject *shown = repr_prefix(raw, len);
                    if (shown == NULL) return G_ERROR;
                    PyObject *message = PyUnicode_FromFormat("has a malformed PUT index %U", shown);
                    Py_DECREF(shown);
                    return refuse(w, message);
                }
                int64_t small;
                PyObject *big;
                TRY(text_index(raw, len, &small, &big));
                if (big != NULL) {
                    PyObject *message = PyUnicode_FromFormat(
                        "stores memo index %S, which no pickler writes (a memory bomb)", big);
                    Py_DECREF(big);
                    return refuse(w, message);
                }
                index = (uint64_t)small;
            }
            if (index > (uint64_t)w->ops)
                REFUSE("stores memo index %llu, which no pickler writes (a memory bomb)", (unsigned long long)index);
            if (w->top <= FENCE(w)) REFUSE("stores a value below its stack (corrupt)");
            if (memo_put(&w->memo, index, w->stack[w->top - 1]) < 0) {
                PyErr_NoMemory();
                return G_ERROR;
            }
            w->memory += 16;
            if (index >= w->memo_top) {  /* the unpickler's memo table reaches this index: 16 bytes for each skipped */
                w->memory += 16 * (int64_t)(index - w->memo_top);
                w->memo_top = index + 1;
            }
            break;
        }
        case 0x68: case 0x6A: case 0x67: {  /* BINGET LONG_BINGET GET */
            int64_t index;
            Rec *value;
            if (code == 0x68) {
                if (w->at >= end) return G_TRUNCATED;
                index = data[w->at++];
            } else if (code == 0x6A) {
                if (w->at + 4 > end) return G_TRUNCATED;
                const unsigned char *p = data + w->at;
                index = (int64_t)((uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) |
                                  ((uint64_t)p[3] << 24));
                w->at += 4;
            } else {
                TRY(line(w, &raw, &len));
                index = -1;
                if (all_digits(raw, len) && len <= MAX_TEXT_DIGITS) {
                    PyObject *big;
                    TRY(text_index(raw, len, &index, &big));
                    if (big != NULL) {  /* past any index stored */
                        PyObject *message = PyUnicode_FromFormat(
                            "reads memo index %S, which was never stored (corrupt)", big);
                        Py_DECREF(big);
                        return refuse(w, message);
                    }
                }
            }
            value = index >= 0 ? memo_get(&w->memo, (uint64_t)index) : NULL;
            if (value == NULL) REFUSE("reads memo index %lld, which was never stored (corrupt)", (long long)index);
            PUSH(value);
            w->memory += 8;
            break;
        }
        case 0x4B:  /* BININT1 */
            if (w->at >= end) return G_TRUNCATED;
            PUSH(&R_BYTE_INTS[data[w->at++]]);
            break;
        case 0x28:  /* MARK */
            if (w->nmarks == w->mcap) {
                Py_ssize_t cap = w->mcap ? w->mcap * 2 : 64;
                Py_ssize_t *marks = PyMem_Realloc(w->marks, (size_t)cap * sizeof(Py_ssize_t));
                if (marks == NULL) {
                    PyErr_NoMemory();
                    return G_ERROR;
                }
                w->marks = marks;
                w->mcap = cap;
            }
            w->marks[w->nmarks++] = w->top;
            w->memory += 8;
            break;
        case 0x58: case 0x8C: {  /* BINUNICODE SHORT_BINUNICODE */
            uint64_t size = 0;
            if (code == 0x58) {  /* int.from_bytes(data[i:i + 4]): fewer bytes at the end */
                Py_ssize_t avail = end - w->at, n = avail < 4 ? avail : 4;
                for (Py_ssize_t k = n - 1; k >= 0; k--) size = (size << 8) | data[w->at + k];
                w->at += 4;
            } else {
                if (w->at >= end) return G_TRUNCATED;
                size = data[w->at++];
            }
            if (past(w->at, size, end)) {
                if (past(w->at, size, w->max_pickle))
                    REFUSE("has a %llu-byte value, over the %lld-byte pickle limit", (unsigned long long)size,
                           (long long)w->max_pickle);
                return G_TRUNCATED;
            }
            PUSH(text_rec(w, data + w->at, (Py_ssize_t)size));
            w->at += (Py_ssize_t)size;
            w->memory += 56 + (int64_t)size;
            break;
        }
        case 0x74: case 0x85: case 0x86: case 0x87: {  /* TUPLE TUPLE1 TUPLE2 TUPLE3 */
            Rec **items;
            Py_ssize_t count;
            if (code == 0x74) {
                TRY(pop_mark(w, &items, &count));
            } else {
                count = code - 0x84;
                if (w->top - count < FENCE(w)) REFUSE("builds a tuple from below its stack (corrupt)");
                items = w->stack + w->top - count;
                w->top -= count;
            }
            PUSH(count ? new_tuple(w, items, count) : &R_EMPTY_TUPLE);
            w->memory += 56 + 8 * (int64_t)count;
            break;
        }
        case 0x52: case 0x81: case 0x92: {  /* REDUCE NEWOBJ NEWOBJ_EX */
            Py_ssize_t count = code == 0x92 ? 3 : 2;
            if (w->top - count < FENCE(w)) REFUSE("calls with too few values on its stack (corrupt)");
            Rec *callable = w->stack[w->top - count], *arguments = w->stack[w->top - 1];
            w->top -= count;
            if (code == 0x52 && arguments->kind == K_TUPLE && arguments->n.gname != NULL && callable->kind == K_GLOBAL &&
                callable->n.gname != NULL && (PyUnicode_CompareWithASCIIString(callable->n.gname, "builtins.getattr") == 0 ||
                                              PyUnicode_CompareWithASCIIString(callable->n.gname, "__builtin__.getattr") == 0)) {
                Rec *r = new_rec(w);  /* getattr(<global>, 'name'): the global <global>.name */
                if (r == NULL) return G_ERROR;
                r->kind = K_GLOBAL;
                r->hashable = 1;
                r->nodes = 1;
                r->n.gname = arguments->n.gname;
                PUSH(r);
            } else {
                PUSH(made_by(w, callable));
            }
            w->memory += PLACEHOLDER_COST;
            break;
        }
        case 0x51:  /* BINPERSID */
            if (w->top <= FENCE(w)) REFUSE("has BINPERSID without an id (corrupt)");
            w->stack[w->top - 1] = &R_OTHER;
            w->memory += PLACEHOLDER_COST;
            break;
        case 0x89: case 0x88: case 0x4E:  /* NEWFALSE NEWTRUE NONE */
            PUSH(code == 0x89 ? &R_FALSE : code == 0x88 ? &R_TRUE : &R_NONE);
            w->memory += 8;
            break;
        case 0x29:  /* EMPTY_TUPLE */
            PUSH(&R_EMPTY_TUPLE);
            break;
        case 0x2E:  /* STOP */
            if (w->top <= FENCE(w)) REFUSE("stops with nothing on its stack (corrupt)");
            if (w->frame_end && w->at != w->frame_end)  /* a stream reader would go on after the frame */
                REFUSE("stops at offset %zd, inside a frame that ends at offset %zd (corrupt)", w->at - 1,
                       w->frame_end);
            return G_OK;
        default:
            TRY(op_rare(w, code));
        }
        if (w->memory > w->max_memory)
            REFUSE("would build over %lld bytes of objects (a memory bomb)", (long long)w->max_memory);
    }
}

/* ---------------------------------------------------------------------------------- the module */

PyDoc_STRVAR(walk_doc,
"walk(data, max_unpickled_bytes, max_pickle_bytes, max_key_nodes, max_hash_collisions, max_nesting,\n"
"     max_globals, torch_globals)\n--\n\n"
"Walk one pickle's opcodes as opcode_guard._Walk.run does. Returns (size, counts, globals) when it\n"
"passes, None when data ends before its STOP (Truncated), or the refusal's message (a str).");

static PyObject *walk(PyObject *module, PyObject *args) {
    PyObject *data;
    long long max_memory, max_pickle, max_nodes, max_collisions, max_depth, max_globals;
    PyObject *torch_globals;
    if (!PyArg_ParseTuple(args, "O!LLLLLLO:walk", &PyBytes_Type, &data, &max_memory, &max_pickle, &max_nodes,
                          &max_collisions, &max_depth, &max_globals, &torch_globals))
        return NULL;
    if (max_depth < 0 || max_depth >= MAX_DEPTH) {  /* a tuple record holds its depth up to MAX_DEPTH */
        PyErr_SetString(PyExc_ValueError, "max_nesting is out of the native walk's range");
        return NULL;
    }
    const long long bound = (long long)1 << 62;  /* beyond: the Python walk (opcode_guard checks the same) */
    if (max_memory < -bound || max_memory > bound || max_pickle < -bound || max_pickle > bound ||
        max_nodes < -bound || max_nodes > bound || max_collisions < -bound || max_collisions > bound ||
        max_globals < -bound || max_globals > bound) {
        PyErr_SetString(PyExc_ValueError, "a limit is out of the native walk's range");
        return NULL;
    }
    Walk w;
    memset(&w, 0, sizeof w);
    w.data = (const unsigned char *)PyBytes_AS_STRING(data);
    w.end = PyBytes_GET_SIZE(data);
    w.max_memory = max_memory;
    w.max_pickle = max_pickle;
    w.max_nodes = max_nodes;
    w.max_collisions = max_collisions;
    w.max_depth = max_depth;
    w.max_globals = max_globals;
    w.torch_globals = torch_globals;
    w.names = PyList_New(0);
    if (w.names == NULL) return NULL;
    Py_INCREF(data);  /* the records point into it */
    int status = run(&w);
    PyObject *result = NULL;
    if (status == G_OK) {
        PyObject *counts = PyList_New(256);
        if (counts != NULL) {
            for (int k = 0; k < 256; k++) {
                PyObject *n = PyLong_FromUnsignedLongLong(w.counts[k]);
                if (n == NULL) {
                    Py_CLEAR(counts);
                    break;
                }
                PyList_SET_ITEM(counts, k, n);
            }
        }
        if (counts != NULL) result = Py_BuildValue("(nNO)", w.at, counts, w.names);
    } else if (status == G_TRUNCATED) {
        result = Py_NewRef(Py_None);
    } else if (status == G_REFUSED) {
        result = Py_NewRef(w.message);
    }
    walk_free(&w);
    Py_DECREF(w.names);
    Py_DECREF(data);
    return result;
}

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS, walk_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef guard_module = {
    PyModuleDef_HEAD_INIT, "_guard", "The opcode guard's walk in C (ckptool.pickles.opcode_guard).", -1, methods,
    NULL, NULL, NULL, NULL,
};

static void shared(Rec *r, int kind, int hashable, PyObject *value) {
    memset(r, 0, sizeof(Rec));
    r->kind = (uint8_t)kind;
    r->hashable = (uint8_t)hashable;
    r->nodes = 1;
    r->vkind = value != NULL ? V_OBJ : V_OPAQUE;
    r->v.obj = value;
}

PyMODINIT_FUNC PyInit__guard(void) {
    static int ready = 0;
    if (!ready) {  /* the shared records hold their values for the life of the process */
        PyObject *empty = PyTuple_New(0);
        UNRESOLVED = PyUnicode_InternFromString("<unresolved STACK_GLOBAL>");
        EMPTY_STR = PyUnicode_FromString("");
        FROM_BYTES_KW = Py_BuildValue("{s:O}", "signed", Py_True);
        LITTLE = PyUnicode_InternFromString("little");
        UNDERSCORES = PyUnicode_InternFromString("__");
        if (UNDERSCORES == NULL) return NULL;
        if (empty == NULL || UNRESOLVED == NULL || EMPTY_STR == NULL || FROM_BYTES_KW == NULL || LITTLE == NULL)
            return NULL;
        shared(&R_STR, K_STR, 1, NULL);
        shared(&R_BYTES, K_BYTES, 1, NULL);
        shared(&R_OTHER, K_OTHER, 0, NULL);
        shared(&R_LIST, K_LIST, 0, NULL);
        shared(&R_EMPTY_TUPLE, K_TUPLE, 1, empty);
        shared(&R_NONE, K_LITERAL, 1, Py_NewRef(Py_None));
        shared(&R_TRUE, K_LITERAL, 1, Py_NewRef(Py_True));
        shared(&R_FALSE, K_LITERAL, 1, Py_NewRef(Py_False));
        for (int k = 0; k < 256; k++) {
            PyObject *value = PyLong_FromLong(k);
            if (value == NULL) return NULL;
            shared(&R_BYTE_INTS[k], K_LITERAL, 1, value);
        }
        ready = 1;
    }
    return PyModule_Create(&guard_module);
}

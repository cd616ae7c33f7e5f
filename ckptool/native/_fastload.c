/* The restricted unpickler's run over the opcodes torch's pickles are made of, in C, with the per-tensor
   callbacks of a state dict done here too.

   ckptool/pickles/unpickle.py runs a guarded pickle through CPython's C unpickler, which calls back into
   Python three times for each tensor: the archive's persistent_load (the storage record), the rebuild
   (torch._utils._rebuild_tensor_v2) and OrderedDict() (its hooks). For 100,000 tensors those calls cost
   more than the unpickling itself. ``load`` here runs the same pickle with the same semantics as
   CPython's unpickler (Modules/_pickle.c), opcode for opcode, over the ~30 opcodes state dicts and
   training containers use; for those three calls it does in C exactly what the Python callbacks do in
   their usual case, and calls them for anything else.

   It returns NotImplemented (and the caller runs CPython's unpickler instead) at the first opcode it
   does not take, and wherever CPython's unpickler would raise an error of its own (a stack underflow,
   a memo read of an index never stored): the caller undoes what the callbacks recorded. An exception a
   callback raises (the resolver's, the archive's) propagates as it would from CPython's unpickler.

   The input was walked by the opcode guard first (ckptool/pickles/opcode_guard.py): its memo indices are
   bounded by its length, its stack is consistent. Every read is still checked against the buffer's
   length; nothing recurses; every exit releases what the run holds. The only Python code called is the
   resolver (for each GLOBAL), the callbacks named above, the callables the resolver returned (REDUCE),
   ``__setstate__`` of what BUILD sets state on, and the dataclasses' constructors: what CPython's
   unpickler would call.

   ``parse_header`` reads a safetensors header into the same refs ckptool/formats/safetensors.py builds from
   it, or returns None where that reading would refuse it or differ (the Python then reads it). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* where a field lies in the instances of one type: read straight from there (slot_attr) */
typedef struct {
    PyTypeObject *type;
    Py_ssize_t offset;  /* 0: not such a slot (getattr) */
} Slot;

#define DECLINE 1  /* not taken here: the caller runs CPython's unpickler */

/* Every 2^16 turns of a loop whose length an input sets, a pending signal's Python handler runs (Ctrl-C raises
   KeyboardInterrupt, SIGTERM ckptool's exit) and its error ends the loop as any error does: a command ends
   within a second however long its input (1: the handler raised, its error set) */
#define SIGNAL_TURNS 0xFFFF
static inline int signalled(Py_ssize_t turn) {
    return (turn & SIGNAL_TURNS) == SIGNAL_TURNS && PyErr_CheckSignals() < 0;
}

typedef struct {
    PyObject **items;
    Py_ssize_t len, cap;
} Stack;

typedef struct {
    const unsigned char *data;
    Py_ssize_t end, at;
    Stack stack;
    Py_ssize_t *marks;
    Py_ssize_t nmarks, mcap, fence;
    PyObject **memo;
    Py_ssize_t memo_cap, memo_len;
    PyObject *find_class, *persistent_load;
    /* the rebuild's fast path (None where the caller gave none) */
    PyObject *rebuild_v2, *tensor_type, *v2_name, *plain_dtypes, *storage_ref_type, *ordered_dict, *state_dict;
    /* the archive's storages (NULL: every record goes to persistent_load) */
    PyObject *storages, *type_globals, *members, *prefix, *source, *base_offset, *not_read, *byte_range_type,
        *storage_type_ref, *member_type;
    int headers_none;
    /* the archive's members met in their order: torch numbers storages as it meets them and writes their members
       in that order, so the next member is looked at before any look-up (see next_member) */
    Py_ssize_t member_pos, cursor_made;
    int cursor_ok;
    /* storages made from members found so, put in ``storages`` only when something looks there (see pend) */
    PyObject **pend_keys, **pend_storages;
    Py_ssize_t npend, pend_cap;
    /* what each storage class and dtype met says (held: released at the end of the run) */
    struct { PyObject *type, *dtype; int64_t itemsize; } types[8];
    struct { PyObject *dtype; int plain; int64_t itemsize; } dtypes[16];
    int type_count, dtype_count;
} Run;

static PyObject *S_STORAGE, *S_DTYPE, *S_NUMEL, *S_ITEMSIZE, *S_NAME, *S_MODULE, *S_DICT, *S_SETSTATE;

/* ------------------------------------------------------------------------------------ the stack */

static int push(Run *r, PyObject *obj) {  /* steals obj; NULL: the error is set */
    if (obj == NULL) return -1;
    if (r->stack.len == r->stack.cap) {
        Py_ssize_t cap = r->stack.cap ? r->stack.cap * 2 : 64;
        PyObject **items = PyMem_Realloc(r->stack.items, (size_t)cap * sizeof(PyObject *));
        if (items == NULL) {
            Py_DECREF(obj);
            PyErr_NoMemory();
            return -1;
        }
        r->stack.items = items;
        r->stack.cap = cap;
    }
    r->stack.items[r->stack.len++] = obj;
    return 0;
}

static PyObject *pop(Run *r) {  /* a new reference; NULL (no error set): below the fence */
    if (r->stack.len <= r->fence) return NULL;
    return r->stack.items[--r->stack.len];
}

static void clear_to(Run *r, Py_ssize_t to) {
    while (r->stack.len > to) {
        r->stack.len--;
        Py_DECREF(r->stack.items[r->stack.len]);
    }
}

static PyObject *tuple_from(Run *r, Py_ssize_t start) {  /* the items from ``start`` up, as a tuple, popped */
    Py_ssize_t n = r->stack.len - start;
    PyObject *t = PyTuple_New(n);
    if (t == NULL) return NULL;
    for (Py_ssize_t k = 0; k < n; k++) PyTuple_SET_ITEM(t, k, r->stack.items[start + k]);  /* steals */
    r->stack.len = start;
    return t;
}

/* pop the last MARK: its stack position, or -1 (none: CPython's "could not find MARK") */
static Py_ssize_t marker(Run *r) {
    if (r->nmarks < 1) return -1;
    Py_ssize_t mark = r->marks[--r->nmarks];
    r->fence = r->nmarks ? r->marks[r->nmarks - 1] : 0;
    return mark;
}

/* ------------------------------------------------------------------------------------- the memo */

static int memo_put(Run *r, Py_ssize_t index, PyObject *value) {
    if (index < 0) return DECLINE;
    if (index >= r->memo_cap) {
        Py_ssize_t cap = r->memo_cap ? r->memo_cap : 64;
        while (cap <= index) cap *= 2;
        PyObject **memo = PyMem_Realloc(r->memo, (size_t)cap * sizeof(PyObject *));
        if (memo == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memset(memo + r->memo_cap, 0, (size_t)(cap - r->memo_cap) * sizeof(PyObject *));
        r->memo = memo;
        r->memo_cap = cap;
    }
    PyObject *old = r->memo[index];
    Py_INCREF(value);
    r->memo[index] = value;
    if (old == NULL) r->memo_len++;
    else Py_DECREF(old);
    return 0;
}

/* ------------------------------------------------------------------------------------- reading */

#define NEED(n) do { if (r->end - r->at < (Py_ssize_t)(n)) return DECLINE; } while (0)

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* one text line (the newline not included); DECLINE if none, or shorter than CPython's readline takes */
static int line(Run *r, const unsigned char **start, Py_ssize_t *len) {
    const unsigned char *p = r->data + r->at;
    const unsigned char *nl = memchr(p, '\n', (size_t)(r->end - r->at));
    if (nl == NULL || nl == p) return DECLINE;  /* CPython: a line under 2 bytes is a bad readline */
    *start = p;
    *len = nl - p;
    r->at += *len + 1;
    return 0;
}

/* ---------------------------------------------------------------------------- the constructors */

/* A slotted dataclass built as its generated __init__ builds it: each field's slot set, in order, to the
   argument given or the field's default. register() takes a class only when every field is a plain
   object slot with at most a plain default and the class has no __post_init__ (ckptool.pickles.unpickle
   checks that, and the tests compare what both build); any other class is called. */
#define MAX_FIELDS 16
typedef struct {
    PyTypeObject *type;
    Py_ssize_t count, required;
    Py_ssize_t offsets[MAX_FIELDS];
    PyObject *defaults[MAX_FIELDS];  /* owned; NULL for a field without one */
} Maker;

static Maker MAKERS[4];
static int MAKER_COUNT;

static PyObject *make(PyObject *type, PyObject *const *args, Py_ssize_t n) {
    for (int k = 0; k < MAKER_COUNT; k++) {
        Maker *m = &MAKERS[k];
        if ((PyObject *)m->type != type) continue;
        if (n < m->required || n > m->count) break;
        PyObject *obj = m->type->tp_alloc(m->type, 0);
        if (obj == NULL) return NULL;
        for (Py_ssize_t i = 0; i < m->count; i++) {
            PyObject *value = i < n ? args[i] : m->defaults[i];
            *(PyObject **)((char *)obj + m->offsets[i]) = Py_NewRef(value);
        }
        return obj;
    }
    return PyObject_Vectorcall(type, args, (size_t)n, NULL);
}

PyDoc_STRVAR(register_doc,
"register(cls, names, defaults)\n\n"
"Build ``cls`` (a slotted dataclass) by setting its slots ``names`` in order; ``defaults`` holds each\n"
"field's default, the required ones first and given as the class itself.");

static PyObject *register_maker(PyObject *self, PyObject *args) {
    PyTypeObject *type;
    PyObject *names, *defaults;
    if (!PyArg_ParseTuple(args, "O!O!O!:register", &PyType_Type, &type, &PyTuple_Type, &names, &PyTuple_Type, &defaults))
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(names);
    if (count > MAX_FIELDS || PyTuple_GET_SIZE(defaults) != count) {
        PyErr_SetString(PyExc_ValueError, "register: too many fields, or defaults of another length");
        return NULL;
    }
    Maker *m = NULL;
    for (int k = 0; k < MAKER_COUNT; k++)
        if (MAKERS[k].type == type) m = &MAKERS[k];
    if (m == NULL) {
        if (MAKER_COUNT == (int)(sizeof MAKERS / sizeof MAKERS[0])) {
            PyErr_SetString(PyExc_ValueError, "register: no room for another class");
            return NULL;
        }
        m = &MAKERS[MAKER_COUNT];
    } else {
        for (Py_ssize_t i = 0; i < m->count; i++) Py_CLEAR(m->defaults[i]);
    }
    Maker made;
    memset(&made, 0, sizeof made);
    made.type = type;
    made.count = count;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *descr = PyDict_GetItemWithError(type->tp_dict, PyTuple_GET_ITEM(names, i));
        if (descr == NULL || Py_TYPE(descr) != &PyMemberDescr_Type ||
            ((PyMemberDescrObject *)descr)->d_member->type != T_OBJECT_EX ||
            (((PyMemberDescrObject *)descr)->d_member->flags & READONLY)) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "register: %R is not a writable object slot",
                                                PyTuple_GET_ITEM(names, i));
            return NULL;
        }
        made.offsets[i] = ((PyMemberDescrObject *)descr)->d_member->offset;
        PyObject *value = PyTuple_GET_ITEM(defaults, i);
        if (value == (PyObject *)type) {
            if (made.required != i) {
                PyErr_SetString(PyExc_ValueError, "register: a required field after a default");
                return NULL;
            }
            made.required = i + 1;
        } else {
            made.defaults[i] = Py_NewRef(value);
        }
    }
    Py_INCREF(type);
    if (m == &MAKERS[MAKER_COUNT]) MAKER_COUNT++;
    else Py_DECREF(m->type);
    *m = made;
    Py_RETURN_NONE;
}

/* --------------------------------------------------------------------------------- fast paths */

/* an int that fits 64 bits, or 0 with *ok = 0 (anything else: not the fast path) */
static int64_t small_int(PyObject *v, int *ok) {
    if (!PyLong_CheckExact(v)) {
        *ok = 0;
        return 0;
    }
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (x == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        *ok = 0;
        return 0;
    }
    return (int64_t)x;
}

static PyObject *slot_attr(PyObject *obj, const char *name, Slot *slot);
static Slot LOAD_SLOTS[2];  /* StorageRef's dtype and numel */

/* what the run met ``dtype`` to be (whether its name is a plain dtype's, its itemsize): 1, or 0 if not met */
static int dtype_met(Run *r, PyObject *dtype, int *plain, int64_t *itemsize) {
    for (int k = 0; k < r->dtype_count; k++)
        if (r->dtypes[k].dtype == dtype) {
            *plain = r->dtypes[k].plain;
            *itemsize = r->dtypes[k].itemsize;
            return 1;
        }
    return 0;
}

static void dtype_meets(Run *r, PyObject *dtype, int plain, int64_t itemsize) {
    if (r->dtype_count == (int)(sizeof r->dtypes / sizeof r->dtypes[0])) return;
    r->dtypes[r->dtype_count].dtype = Py_NewRef(dtype);
    r->dtypes[r->dtype_count].plain = plain;
    r->dtypes[r->dtype_count++].itemsize = itemsize;
}

/* a storage class's dtype (borrowed: held by the run) and its itemsize, as the run met them; NULL if not met */
static PyObject *type_met(Run *r, PyObject *type, int64_t *itemsize) {
    for (int k = 0; k < r->type_count; k++)
        if (r->types[k].type == type) {
            *itemsize = r->types[k].itemsize;
            return r->types[k].dtype;
        }
    return NULL;
}

static void type_meets(Run *r, PyObject *type, PyObject *dtype, int64_t itemsize) {
    if (r->type_count == (int)(sizeof r->types / sizeof r->types[0])) return;
    r->types[r->type_count].type = Py_NewRef(type);
    r->types[r->type_count].dtype = Py_NewRef(dtype);
    r->types[r->type_count++].itemsize = itemsize;
}

static void forget_met(Run *r) {
    for (int k = 0; k < r->type_count; k++) {
        Py_DECREF(r->types[k].type);
        Py_DECREF(r->types[k].dtype);
    }
    for (int k = 0; k < r->dtype_count; k++) Py_DECREF(r->dtypes[k].dtype);
    r->type_count = r->dtype_count = 0;
}

/* whether ``text`` is ``prefix`` followed by ``key`` (str of one byte a character each), compared where they lie */
static int joined_is(PyObject *text, PyObject *prefix, PyObject *key) {
    if (!PyUnicode_CheckExact(text) || PyUnicode_KIND(text) != PyUnicode_1BYTE_KIND ||
        PyUnicode_KIND(prefix) != PyUnicode_1BYTE_KIND || PyUnicode_KIND(key) != PyUnicode_1BYTE_KIND)
        return 0;
    Py_ssize_t np = PyUnicode_GET_LENGTH(prefix), nk = PyUnicode_GET_LENGTH(key);
    if (PyUnicode_GET_LENGTH(text) != np + nk) return 0;
    const Py_UCS1 *t = PyUnicode_1BYTE_DATA(text);
    return memcmp(t, PyUnicode_1BYTE_DATA(prefix), (size_t)np) == 0 &&
           memcmp(t + np, PyUnicode_1BYTE_DATA(key), (size_t)nk) == 0;
}

/* A storage made from a member found ahead is of a key not met (next_member): it goes into ``storages`` (a
   100,000-entry dict: an insert is a few cache misses) only when something is to look there, the look-up of a
   key met before or the Python persistent_load, and at the end of the run. 0, or -1 with an error set. */
static int pend(Run *r, PyObject *key, PyObject *storage) {
    if (r->npend == r->pend_cap) {
        Py_ssize_t cap = r->pend_cap ? r->pend_cap * 2 : 256;
        PyObject **keys = PyMem_Realloc(r->pend_keys, (size_t)cap * sizeof(PyObject *));
        if (keys == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        r->pend_keys = keys;
        PyObject **storages = PyMem_Realloc(r->pend_storages, (size_t)cap * sizeof(PyObject *));
        if (storages == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        r->pend_storages = storages;
        r->pend_cap = cap;
    }
    r->pend_keys[r->npend] = Py_NewRef(key);
    r->pend_storages[r->npend++] = Py_NewRef(storage);
    return 0;
}

static int flush_pending(Run *r) {  /* what pend held, into ``storages`` in the order it was made */
    int status = 0;
    for (Py_ssize_t k = 0; k < r->npend; k++) {
        if (status == 0 && PyDict_SetItem(r->storages, r->pend_keys[k], r->pend_storages[k]) < 0) status = -1;
        Py_DECREF(r->pend_keys[k]);
        Py_DECREF(r->pend_storages[k]);
    }
    r->npend = 0;
    return status;
}

#define MEMBERS_AHEAD 16  /* how far past the last storage's member the next one is looked for */

/* The member of a storage record whose key the run has not met: the next members of the archive (in its
   order, at most MEMBERS_AHEAD on) are looked at for ``prefix + key``. Borrowed; NULL if not there (then the
   key is looked up: met before, or out of order) or if the run has stopped looking (a storage was made from
   a look-up: its member may lie ahead). While every storage made so far was made from a member found so,
   all lie before ``member_pos``: one found after it is of a key not met. */
static PyObject *next_member(Run *r, PyObject *key) {
    if (!r->cursor_ok || PyDict_GET_SIZE(r->storages) + r->npend != r->cursor_made) return NULL;
    Py_ssize_t pos = r->member_pos;
    PyObject *name, *member;
    for (int k = 0; k < MEMBERS_AHEAD && PyDict_Next(r->members, &pos, &name, &member); k++)
        if (joined_is(name, r->prefix, key)) {
            r->member_pos = pos;
            return member;
        }
    return NULL;
}

/* rebuilds._rebuild_tensor_v2's usual case, checked as it checks it: the TensorRef, or NULL with no error
   set (not the usual case: the Python function decides), or NULL with an error */
static PyObject *plain_tensor(Run *r, PyObject *args) {
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n < 4 || n > 6) return NULL;
    PyObject *storage = PyTuple_GET_ITEM(args, 0), *offset = PyTuple_GET_ITEM(args, 1);
    PyObject *size = PyTuple_GET_ITEM(args, 2), *stride = PyTuple_GET_ITEM(args, 3);
    PyObject *requires_grad = n > 4 ? PyTuple_GET_ITEM(args, 4) : Py_False;
    PyObject *hooks = n > 5 ? PyTuple_GET_ITEM(args, 5) : Py_None;
    if ((PyObject *)Py_TYPE(storage) != r->storage_ref_type || !PyTuple_CheckExact(size) ||
        !PyTuple_CheckExact(stride) || !PyLong_CheckExact(offset) || (requires_grad != Py_False && requires_grad != Py_True))
        return NULL;
    Py_ssize_t dims = PyTuple_GET_SIZE(size);
    if (dims != PyTuple_GET_SIZE(stride) || dims > 64) return NULL;
    int ok = 1;
    int64_t at = small_int(offset, &ok);
    if (!ok || at < 0) return NULL;
    PyObject *dtype = slot_attr(storage, "dtype", &LOAD_SLOTS[0]);
    if (dtype == NULL) return NULL;
    int plain;
    int64_t itemsize;
    int met = dtype_met(r, dtype, &plain, &itemsize);
    if (!met) {
        PyObject *name = PyObject_GetAttr(dtype, S_NAME);
        if (name == NULL) goto fail;
        plain = PySet_Contains(r->plain_dtypes, name);
        Py_DECREF(name);
        if (plain < 0) goto fail;
        if (!plain) dtype_meets(r, dtype, 0, 0);
    }
    if (!plain) goto not_plain;
    int64_t last = at, count = 1;
    for (Py_ssize_t k = 0; k < dims; k++) {
        int64_t dim = small_int(PyTuple_GET_ITEM(size, k), &ok), step = small_int(PyTuple_GET_ITEM(stride, k), &ok);
        if (!ok || dim < 0 || step < 0) goto not_plain;
        int64_t span;
        if (__builtin_mul_overflow(count, dim, &count) || __builtin_mul_overflow(dim - 1, step, &span) ||
            __builtin_add_overflow(last, span, &last))
            goto not_plain;
    }
    if (!met) {
        PyObject *itemsize_obj = PyObject_GetAttr(dtype, S_ITEMSIZE);
        if (itemsize_obj == NULL) goto fail;
        itemsize = small_int(itemsize_obj, &ok);
        Py_DECREF(itemsize_obj);
        if (ok && itemsize > 0) dtype_meets(r, dtype, 1, itemsize);
    }
    PyObject *numel_obj = slot_attr(storage, "numel", &LOAD_SLOTS[1]);
    if (numel_obj == NULL) goto fail;
    int64_t numel = small_int(numel_obj, &ok);
    Py_DECREF(numel_obj);
    int64_t need, have;
    if (!ok || itemsize <= 0 || numel < 0) goto not_plain;
    if (count != 0) {
        if (__builtin_add_overflow(last, 1, &need) || __builtin_mul_overflow(need, itemsize, &need) ||
            __builtin_mul_overflow(itemsize, numel, &have) || need > have)
            goto not_plain;
    }
    PyObject *empty = PyTuple_New(0);
    if (empty == NULL) goto fail;
    PyObject *call[9] = {storage, dtype, size, stride, offset, requires_grad, r->v2_name, empty, hooks};
    PyObject *tensor = make(r->tensor_type, call, 9);
    Py_DECREF(empty);
    Py_DECREF(dtype);
    return tensor;
not_plain:
    Py_DECREF(dtype);
    PyErr_Clear();
    return NULL;
fail:
    Py_DECREF(dtype);
    return NULL;
}

/* the archive's persistent_load in its usual case (torch_zip.storage_loader: a record of a storage in
   the archive, read where it lies): the StorageRef, or NULL with no error set (persistent_load decides) */
static PyObject *plain_storage(Run *r, PyObject *pid) {
    if (r->storages == NULL || !PyTuple_CheckExact(pid) || PyTuple_GET_SIZE(pid) != 5) return NULL;
    PyObject *tag = PyTuple_GET_ITEM(pid, 0), *type = PyTuple_GET_ITEM(pid, 1), *key = PyTuple_GET_ITEM(pid, 2);
    PyObject *location = PyTuple_GET_ITEM(pid, 3), *numel_obj = PyTuple_GET_ITEM(pid, 4);
    if (!PyUnicode_CheckExact(tag) || PyUnicode_Compare(tag, S_STORAGE) != 0 ||
        (PyObject *)Py_TYPE(type) != r->storage_type_ref || !PyUnicode_CheckExact(key) ||
        !PyUnicode_CheckExact(location))
        return NULL;
    int ok = 1;
    int64_t numel = small_int(numel_obj, &ok);
    if (!ok || numel < 0) return NULL;
    PyObject *member = next_member(r, key);  /* borrowed */
    int ahead = member != NULL;
    if (!ahead) {
        if (flush_pending(r) < 0) return NULL;
        PyObject *cached = PyDict_GetItemWithError(r->storages, key);  /* borrowed */
        if (cached != NULL || PyErr_Occurred()) {
            PyErr_Clear();
            return NULL;  /* shared storages and their dtypes: persistent_load */
        }
    }
    int64_t itemsize, nbytes;
    PyObject *dtype = type_met(r, type, &itemsize);
    if (dtype != NULL) {
        Py_INCREF(dtype);
    } else {
        dtype = PyObject_GetAttr(type, S_DTYPE);
        if (dtype == NULL) return NULL;
        PyObject *itemsize_obj = PyObject_GetAttr(dtype, S_ITEMSIZE);
        if (itemsize_obj == NULL) {
            Py_DECREF(dtype);
            return NULL;
        }
        itemsize = small_int(itemsize_obj, &ok);
        Py_DECREF(itemsize_obj);
        if (ok && itemsize > 0) type_meets(r, type, dtype, itemsize);
    }
    PyObject *name = NULL, *storage = NULL, *range = NULL, *type_global = NULL;
    if (!ok || itemsize <= 0 || __builtin_mul_overflow(numel, itemsize, &nbytes)) goto out;
    if (!ahead) {
        name = PyUnicode_Concat(r->prefix, key);
        if (name == NULL) goto out;
        member = PyDict_GetItemWithError(r->members, name);  /* borrowed: dict.get, as the exact lookup */
    }
    if (member == NULL || (PyObject *)Py_TYPE(member) != r->member_type || PyTuple_GET_SIZE(member) < 5) goto out;
    PyObject *data_offset_obj = PyTuple_GET_ITEM(member, 1), *size_obj = PyTuple_GET_ITEM(member, 2);
    PyObject *crc_obj = PyTuple_GET_ITEM(member, 3), *compressed = PyTuple_GET_ITEM(member, 4);
    if (compressed != Py_False) goto out;
    int64_t size = small_int(size_obj, &ok), data_offset = small_int(data_offset_obj, &ok);
    int64_t crc = small_int(crc_obj, &ok), base = small_int(r->base_offset, &ok), not_read = small_int(r->not_read, &ok);
    if (!ok || size < nbytes || (data_offset == not_read && !r->headers_none)) goto out;
    int64_t at;
    if (__builtin_add_overflow(base, data_offset, &at)) goto out;
    type_global = PyDict_GetItemWithError(r->type_globals, type);  /* borrowed */
    if (type_global == NULL) {
        if (PyErr_Occurred()) goto out;
        PyObject *module = PyObject_GetAttr(type, S_MODULE), *tname = module ? PyObject_GetAttr(type, S_NAME) : NULL;
        PyObject *joined = tname ? PyUnicode_FromFormat("%S.%S", module, tname) : NULL;
        Py_XDECREF(module);
        Py_XDECREF(tname);
        if (joined == NULL || PyDict_SetItem(r->type_globals, type, joined) < 0) {
            Py_XDECREF(joined);
            type_global = NULL;
            goto out;
        }
        Py_DECREF(joined);
        type_global = PyDict_GetItemWithError(r->type_globals, type);
        if (type_global == NULL) goto out;
    }
    {
        PyObject *at_obj = PyLong_FromLongLong(at), *nbytes_obj = PyLong_FromLongLong(nbytes);
        PyObject *crc_value = (size != nbytes || !(crc || !nbytes)) ? Py_NewRef(Py_None) : Py_NewRef(crc_obj);
        if (at_obj != NULL && nbytes_obj != NULL) {
            PyObject *call[4] = {r->source, at_obj, nbytes_obj, crc_value};
            range = make(r->byte_range_type, call, 4);
        }
        Py_XDECREF(at_obj);
        Py_XDECREF(nbytes_obj);
        Py_DECREF(crc_value);
        if (range == NULL) goto out;
    }
    {
        PyObject *call[6] = {key, dtype, numel_obj, location, range, type_global};
        storage = make(r->storage_ref_type, call, 6);
    }
    if (storage != NULL && (ahead ? pend(r, key, storage) : PyDict_SetItem(r->storages, key, storage)) < 0)
        Py_CLEAR(storage);
    if (storage != NULL && ahead) r->cursor_made++;
out:
    Py_DECREF(dtype);
    Py_XDECREF(name);
    Py_XDECREF(range);
    return storage;
}

/* --------------------------------------------------------------------------------- the opcodes */

static int setitems(Run *r, Py_ssize_t x) {  /* CPython's do_setitems */
    Py_ssize_t len = r->stack.len;
    if (x > len || x <= r->fence) return DECLINE;
    if (len == x) return 0;
    if ((len - x) % 2 != 0) return DECLINE;
    PyObject *dict = r->stack.items[x - 1];
    for (Py_ssize_t i = x + 1; i < len; i += 2)
        if (signalled((i - x) >> 1) || PyObject_SetItem(dict, r->stack.items[i - 1], r->stack.items[i]) < 0) return -1;
    clear_to(r, x);
    return 0;
}

static int appends(Run *r, Py_ssize_t x) {  /* CPython's do_append, for a list (anything else: declined) */
    Py_ssize_t len = r->stack.len;
    if (x > len || x <= r->fence) return DECLINE;
    if (len == x) return 0;
    PyObject *list = r->stack.items[x - 1];
    if (!PyList_CheckExact(list)) return DECLINE;
    for (Py_ssize_t i = x; i < len; i++)
        if (signalled(i - x) || PyList_Append(list, r->stack.items[i]) < 0) return -1;
    clear_to(r, x);
    return 0;
}

static int build(Run *r) {  /* CPython's load_build, but a (state, slotstate) pair is declined */
    if (r->stack.len - 2 < r->fence) return DECLINE;
    PyObject *state = r->stack.items[r->stack.len - 1], *inst = r->stack.items[r->stack.len - 2];
    PyObject *setstate = PyObject_GetAttr(inst, S_SETSTATE);
    if (setstate != NULL) {
        PyObject *result = PyObject_CallOneArg(setstate, state);
        Py_DECREF(setstate);
        if (result == NULL) return -1;
        Py_DECREF(result);
        clear_to(r, r->stack.len - 1);
        return 0;
    }
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
    PyErr_Clear();
    if (state == Py_None) {
        clear_to(r, r->stack.len - 1);
        return 0;
    }
    if (!PyDict_Check(state)) return DECLINE;
    PyObject *dict = PyObject_GetAttr(inst, S_DICT);
    if (dict == NULL) return -1;
    Py_ssize_t i = 0;
    PyObject *key, *value;
    while (PyDict_Next(state, &i, &key, &value)) {
        Py_INCREF(key);
        if (PyUnicode_CheckExact(key)) PyUnicode_InternInPlace(&key);
        int failed = PyObject_SetItem(dict, key, value) < 0;
        Py_DECREF(key);
        if (failed) {
            Py_DECREF(dict);
            return -1;
        }
    }
    Py_DECREF(dict);
    clear_to(r, r->stack.len - 1);
    return 0;
}

static int global(Run *r, PyObject *module, PyObject *name) {  /* steals both */
    PyObject *found = NULL;
    if (module != NULL && name != NULL) {
        PyObject *call[2] = {module, name};
        found = PyObject_Vectorcall(r->find_class, call, 2, NULL);
    }
    Py_XDECREF(module);
    Py_XDECREF(name);
    return push(r, found);
}

static int reduce(Run *r) {
    PyObject *args = pop(r);
    if (args == NULL) return DECLINE;
    PyObject *callable = pop(r);
    if (callable == NULL) {
        Py_DECREF(args);
        return DECLINE;
    }
    if (!PyTuple_Check(args)) {  /* CPython raises TypeError: its message is the caller's to give */
        Py_DECREF(args);
        Py_DECREF(callable);
        return DECLINE;
    }
    PyObject *result = NULL;
    if (callable == r->rebuild_v2 && PyTuple_CheckExact(args)) {
        result = plain_tensor(r, args);
        if (result == NULL && PyErr_Occurred()) goto done;
    } else if (callable == r->ordered_dict && PyTuple_GET_SIZE(args) == 0) {
        result = PyObject_CallNoArgs(r->state_dict);  /* what _ordered_dict() returns */
        goto done;
    }
    if (result == NULL) result = PyObject_Call(callable, args, NULL);
done:
    Py_DECREF(args);
    Py_DECREF(callable);
    return push(r, result);
}

static int persid(Run *r) {
    PyObject *pid = pop(r);
    if (pid == NULL) return DECLINE;
    PyObject *obj = plain_storage(r, pid);
    if (obj == NULL && !PyErr_Occurred() && flush_pending(r) == 0)  /* (persistent_load looks in storages) */
        obj = PyObject_CallOneArg(r->persistent_load, pid);
    Py_DECREF(pid);
    return push(r, obj);
}

static PyObject *from_le(const unsigned char *p, Py_ssize_t n) {  /* LONG1's two's complement, n <= 8 */
    if (n == 0) return PyLong_FromLong(0);
    uint64_t u = 0;
    for (Py_ssize_t k = n - 1; k >= 0; k--) u = (u << 8) | p[k];
    if (n < 8 && (p[n - 1] & 0x80)) u |= ~(uint64_t)0 << (8 * n);
    return PyLong_FromLongLong((long long)(int64_t)u);
}

/* one opcode: 0, DECLINE, -1 (an error set), or 2 at STOP */
static int step(Run *r, PyObject **result) {
    if (r->at >= r->end) return DECLINE;
    unsigned char code = r->data[r->at++];
    const unsigned char *p;
    Py_ssize_t len;
    switch (code) {
    case 0x80:  /* PROTO */
        NEED(1);
        if (r->data[r->at++] > 5) return DECLINE;
        return 0;
    case 0x7D:  /* EMPTY_DICT */
        return push(r, PyDict_New());
    case 0x5D:  /* EMPTY_LIST */
        return push(r, PyList_New(0));
    case 0x29:  /* EMPTY_TUPLE */
        return push(r, PyTuple_New(0));
    case 0x28:  /* MARK */
        if (r->nmarks == r->mcap) {
            Py_ssize_t cap = r->mcap ? r->mcap * 2 : 16;
            Py_ssize_t *marks = PyMem_Realloc(r->marks, (size_t)cap * sizeof(Py_ssize_t));
            if (marks == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            r->marks = marks;
            r->mcap = cap;
        }
        r->marks[r->nmarks++] = r->fence = r->stack.len;
        return 0;
    case 0x58: case 0x8C: {  /* BINUNICODE SHORT_BINUNICODE */
        uint64_t size;
        if (code == 0x58) {
            NEED(4);
            size = le32(r->data + r->at);
            r->at += 4;
        } else {
            NEED(1);
            size = r->data[r->at++];
        }
        if ((uint64_t)(r->end - r->at) < size) return DECLINE;
        PyObject *text = PyUnicode_DecodeUTF8((const char *)r->data + r->at, (Py_ssize_t)size, "surrogatepass");
        r->at += (Py_ssize_t)size;
        if (text == NULL) {  /* CPython raises UnicodeDecodeError: the caller's message */
            PyErr_Clear();
            return DECLINE;
        }
        return push(r, text);
    }
    case 0x71: case 0x72: case 0x94: {  /* BINPUT LONG_BINPUT MEMOIZE */
        Py_ssize_t index;
        if (code == 0x71) {
            NEED(1);
            index = r->data[r->at++];
        } else if (code == 0x72) {
            NEED(4);
            index = (Py_ssize_t)le32(r->data + r->at);
            r->at += 4;
        } else {
            index = r->memo_len;
        }
        if (r->stack.len <= r->fence) return DECLINE;
        return memo_put(r, index, r->stack.items[r->stack.len - 1]);
    }
    case 0x68: case 0x6A: {  /* BINGET LONG_BINGET */
        Py_ssize_t index;
        if (code == 0x68) {
            NEED(1);
            index = r->data[r->at++];
        } else {
            NEED(4);
            index = (Py_ssize_t)le32(r->data + r->at);
            r->at += 4;
        }
        if (index >= r->memo_cap || r->memo[index] == NULL) return DECLINE;
        return push(r, Py_NewRef(r->memo[index]));
    }
    case 0x4B:  /* BININT1 */
        NEED(1);
        return push(r, PyLong_FromLong(r->data[r->at++]));
    case 0x4D:  /* BININT2 */
        NEED(2);
        p = r->data + r->at;
        r->at += 2;
        return push(r, PyLong_FromLong((long)p[0] | ((long)p[1] << 8)));
    case 0x4A:  /* BININT */
        NEED(4);
        p = r->data + r->at;
        r->at += 4;
        return push(r, PyLong_FromLong((long)(int32_t)le32(p)));
    case 0x8A:  /* LONG1 */
        NEED(1);
        len = r->data[r->at++];
        if (len > 8) return DECLINE;
        NEED(len);
        p = r->data + r->at;
        r->at += len;
        return push(r, from_le(p, len));
    case 0x47: {  /* BINFLOAT */
        NEED(8);
        double value = PyFloat_Unpack8((const char *)r->data + r->at, 0);
        r->at += 8;
        if (value == -1.0 && PyErr_Occurred()) return -1;
        return push(r, PyFloat_FromDouble(value));
    }
    case 0x88:  /* NEWTRUE */
        return push(r, Py_NewRef(Py_True));
    case 0x89:  /* NEWFALSE */
        return push(r, Py_NewRef(Py_False));
    case 0x4E:  /* NONE */
        return push(r, Py_NewRef(Py_None));
    case 0x74: {  /* TUPLE */
        Py_ssize_t mark = marker(r);
        if (mark < 0 || mark > r->stack.len) return DECLINE;
        if (mark < r->fence) return DECLINE;
        return push(r, tuple_from(r, mark));
    }
    case 0x85: case 0x86: case 0x87: {  /* TUPLE1 TUPLE2 TUPLE3 */
        Py_ssize_t start = r->stack.len - (code - 0x84);
        if (start < r->fence) return DECLINE;
        return push(r, tuple_from(r, start));
    }
    case 0x63: {  /* GLOBAL */
        const unsigned char *m, *n;
        Py_ssize_t mlen, nlen;
        if (line(r, &m, &mlen) || line(r, &n, &nlen)) return DECLINE;
        PyObject *module = PyUnicode_DecodeUTF8((const char *)m, mlen, "strict");
        PyObject *name = module ? PyUnicode_DecodeUTF8((const char *)n, nlen, "strict") : NULL;
        if (module == NULL || name == NULL) {
            Py_XDECREF(module);
            PyErr_Clear();
            return DECLINE;
        }
        return global(r, module, name);
    }
    case 0x93: {  /* STACK_GLOBAL */
        PyObject *name = pop(r);
        if (name == NULL) return DECLINE;
        PyObject *module = pop(r);
        if (module == NULL || !PyUnicode_CheckExact(name) || !PyUnicode_CheckExact(module)) {
            Py_DECREF(name);
            Py_XDECREF(module);
            return DECLINE;
        }
        return global(r, module, name);
    }
    case 0x52:  /* REDUCE */
        return reduce(r);
    case 0x51:  /* BINPERSID */
        return persid(r);
    case 0x73:  /* SETITEM */
        return setitems(r, r->stack.len - 2);
    case 0x75: {  /* SETITEMS */
        Py_ssize_t mark = marker(r);
        return mark < 0 ? DECLINE : setitems(r, mark);
    }
    case 0x61:  /* APPEND */
        return appends(r, r->stack.len - 1);
    case 0x65: {  /* APPENDS */
        Py_ssize_t mark = marker(r);
        return mark < 0 ? DECLINE : appends(r, mark);
    }
    case 0x62:  /* BUILD */
        return build(r);
    case 0x2E: {  /* STOP */
        PyObject *value = pop(r);
        if (value == NULL) return DECLINE;
        *result = value;
        return 2;
    }
    default:
        return DECLINE;
    }
}

static PyObject *item(PyObject *tuple, Py_ssize_t k) { return PyTuple_GET_ITEM(tuple, k); }

/* getattr(obj, name) by a name interned once (names are string literals: known by their address) */
static struct { const char *name; PyObject *interned; } ATTR_NAMES[32];

static PyObject *attr(PyObject *obj, const char *name) {
    size_t k = 0;
    for (; k < sizeof ATTR_NAMES / sizeof ATTR_NAMES[0] && ATTR_NAMES[k].name != NULL; k++)
        if (ATTR_NAMES[k].name == name) return PyObject_GetAttr(obj, ATTR_NAMES[k].interned);
    if (k == sizeof ATTR_NAMES / sizeof ATTR_NAMES[0]) return PyObject_GetAttrString(obj, name);
    PyObject *interned = PyUnicode_InternFromString(name);
    if (interned == NULL) return NULL;
    ATTR_NAMES[k].interned = interned;
    ATTR_NAMES[k].name = name;
    return PyObject_GetAttr(obj, interned);
}

/* getattr(obj, name), read straight from the instance's slot where ``name`` is a plain object slot of its type
   (a slotted dataclass's field: what its member descriptor would read), found once per type in ``slot`` */
static PyObject *slot_attr(PyObject *obj, const char *name, Slot *slot) {
    PyTypeObject *type = Py_TYPE(obj);
    if (slot->type != type) {
        slot->type = type;
        slot->offset = 0;
        if (type->tp_getattro == PyObject_GenericGetAttr) {
            PyObject *key = PyUnicode_InternFromString(name);
            if (key == NULL) return NULL;
            PyObject *descr = _PyType_Lookup(type, key);  /* borrowed; a data descriptor outranks any instance dict */
            Py_DECREF(key);
            if (descr != NULL && Py_TYPE(descr) == &PyMemberDescr_Type &&
                ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX)
                slot->offset = ((PyMemberDescrObject *)descr)->d_member->offset;
        }
    }
    if (slot->offset > 0) {
        PyObject *value = *(PyObject **)((char *)obj + slot->offset);
        if (value != NULL) return Py_NewRef(value);
    }
    return attr(obj, name);  /* (an unset slot raises its AttributeError there) */
}

/* str(n) of an n >= 0, written here (PyUnicode_FromFormat's printf was ~3% of a 100,000-tensor write) */
static PyObject *decimal_text(Py_ssize_t n) {
    char digits[24];
    char *at = digits + sizeof digits;
    do {
        *--at = (char)('0' + n % 10);
        n /= 10;
    } while (n > 0);
    Py_ssize_t length = digits + sizeof digits - at;
    PyObject *text = PyUnicode_New(length, 127);
    if (text != NULL) memcpy(PyUnicode_1BYTE_DATA(text), at, (size_t)length);
    return text;
}

PyDoc_STRVAR(load_doc,
"load(data, find_class, persistent_load, rebuild, storages) -> object or NotImplemented\n\n"
"Unpickle ``data`` as CPython's unpickler would with these callbacks; NotImplemented where it would\n"
"take an opcode this run does not, or raise an error of its own. ``rebuild``: (rebuild_v2, TensorRef,\n"
"its rebuild name, the plain dtypes' names, StorageRef, _ordered_dict, StateDict). ``storages``: None, or\n"
"(storages, type_globals, members, prefix, source, base_offset, NOT_READ, headers is None, ByteRange,\n"
"StorageTypeRef, Member): the archive's persistent_load state, shared with it.");

static PyObject *load(PyObject *self, PyObject *args) {
    PyObject *data, *find_class, *persistent_load, *rebuild, *storages;
    if (!PyArg_ParseTuple(args, "O!OOO!O:load", &PyBytes_Type, &data, &find_class, &persistent_load, &PyTuple_Type,
                          &rebuild, &storages))
        return NULL;
    if (PyTuple_GET_SIZE(rebuild) != 7 || (storages != Py_None && (!PyTuple_Check(storages) ||
                                                                   PyTuple_GET_SIZE(storages) != 11))) {
        PyErr_SetString(PyExc_ValueError, "load: malformed rebuild or storages tuple");
        return NULL;
    }
    Run r;
    memset(&r, 0, sizeof r);
    r.data = (const unsigned char *)PyBytes_AS_STRING(data);
    r.end = PyBytes_GET_SIZE(data);
    r.find_class = find_class;
    r.persistent_load = persistent_load;
    r.rebuild_v2 = item(rebuild, 0);
    r.tensor_type = item(rebuild, 1);
    r.v2_name = item(rebuild, 2);
    r.plain_dtypes = item(rebuild, 3);
    r.storage_ref_type = item(rebuild, 4);
    r.ordered_dict = item(rebuild, 5);
    r.state_dict = item(rebuild, 6);
    if (!PyAnySet_Check(r.plain_dtypes)) {
        PyErr_SetString(PyExc_TypeError, "load: the plain dtypes must be a set");
        return NULL;
    }
    if (storages != Py_None) {
        r.storages = item(storages, 0);
        r.type_globals = item(storages, 1);
        r.members = item(storages, 2);
        r.prefix = item(storages, 3);
        r.source = item(storages, 4);
        r.base_offset = item(storages, 5);
        r.not_read = item(storages, 6);
        r.headers_none = PyObject_IsTrue(item(storages, 7));
        r.byte_range_type = item(storages, 8);
        r.storage_type_ref = item(storages, 9);
        r.member_type = item(storages, 10);
        if (!PyDict_Check(r.storages) || !PyDict_Check(r.type_globals) || !PyDict_Check(r.members) ||
            !PyUnicode_Check(r.prefix) || r.headers_none < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "load: malformed storages tuple");
            return NULL;
        }
        r.cursor_ok = PyDict_GET_SIZE(r.storages) == 0 && PyUnicode_CheckExact(r.prefix);
    }
    PyObject *result = NULL;
    int status;
    Py_ssize_t turns = 0;
    while ((status = step(&r, &result)) == 0) {
        if (signalled(++turns)) {
            status = -1;
            break;
        }
    }
    /* the storages read, as the Python loader leaves them (a failed run's too: its error kept) */
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *raised = PyErr_GetRaisedException();
#else
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *raised = type;
#endif
    if (flush_pending(&r) < 0 && raised == NULL) {
        Py_CLEAR(result);
        status = -1;
    } else {
        if (raised != NULL) PyErr_Clear();  /* (the run's own error is the one to raise) */
#if PY_VERSION_HEX >= 0x030C0000
        PyErr_SetRaisedException(raised);
#else
        PyErr_Restore(type, value, traceback);
#endif
    }
    PyMem_Free(r.pend_keys);
    PyMem_Free(r.pend_storages);
    clear_to(&r, 0);
    PyMem_Free(r.stack.items);
    PyMem_Free(r.marks);
    for (Py_ssize_t k = 0; k < r.memo_cap; k++) Py_XDECREF(r.memo[k]);
    PyMem_Free(r.memo);
    forget_met(&r);
    if (status == 2) return result;
    if (status == DECLINE) Py_RETURN_NOTIMPLEMENTED;
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "load: failed without an error");
    return NULL;
}

/* an exact int in [0, 2^63): its value, or -1 (no error set) for anything else */
static int64_t count_of(PyObject *v) {
    if (!PyLong_CheckExact(v)) return -1;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || x < 0) {
        if (x == -1 && PyErr_Occurred()) PyErr_Clear();
        return -1;
    }
    return (int64_t)x;
}

typedef struct {
    int64_t begin, end;
} Span;

static int span_order(const void *a, const void *b) {
    const Span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* whether the spans tile the data section exactly: no gaps, no overlaps, nothing after them (sorts them) */
static int tiled(Span *spans, Py_ssize_t n, int64_t data_start, int64_t file_size) {
    qsort(spans, (size_t)n, sizeof(Span), span_order);
    int64_t position = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (spans[k].begin != position) return 0;
        position = spans[k].end;
    }
    return data_start + position == file_size;
}

/* tensors[name] = TensorRef(StorageRef(name, dtype, numel, location, ByteRange(path, start, nbytes)), dtype, shape,
   contiguous_stride(shape)): one safetensors header entry as safetensors._each_tensor builds it (``constants``:
   parse_header's). 0, or -1 with an error set (``shape`` NULL: its making failed) */
/* the tensor of one header entry, put in ``tensors`` under ``name``: 0, 1 (the name is there already: declined), or
   -1 (an error) */
static int add_header_tensor(PyObject *tensors, PyObject *name, PyObject *dtype, PyObject *shape, PyObject *stride,
                             int64_t numel, int64_t start, int64_t nbytes, PyObject *path, PyObject *constants) {
    PyObject *start_obj = PyLong_FromLongLong(start), *nbytes_obj = PyLong_FromLongLong(nbytes);
    PyObject *numel_obj = PyLong_FromLongLong(numel);
    PyObject *range = NULL, *storage = NULL, *tensor = NULL;
    if (start_obj && nbytes_obj && numel_obj) {
        PyObject *range_args[3] = {path, start_obj, nbytes_obj};
        range = make(item(constants, 0), range_args, 3);
    }
    if (range) {
        PyObject *storage_args[5] = {name, dtype, numel_obj, item(constants, 5), range};
        storage = make(item(constants, 1), storage_args, 5);
    }
    if (storage) {
        PyObject *tensor_args[4] = {storage, dtype, shape, stride};
        tensor = make(item(constants, 2), tensor_args, 4);
    }
    /* one look-up: the name's first entry goes in; a second finds the first (a duplicate key: json keeps the last) */
    PyObject *present = tensor == NULL ? NULL : PyDict_SetDefault(tensors, name, tensor);  /* borrowed */
    int status = present == NULL ? -1 : present != tensor ? 1 : 0;
    Py_XDECREF(start_obj);
    Py_XDECREF(nbytes_obj);
    Py_XDECREF(numel_obj);
    Py_XDECREF(range);
    Py_XDECREF(storage);
    Py_XDECREF(tensor);
    return status;
}

/* ---------------------------------------------------------------- a safetensors header, parsed */

typedef struct {
    const unsigned char *p, *end;
} Cursor;

static void skip_ws(Cursor *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r')) c->p++;
}

static int take(Cursor *c, unsigned char ch) {  /* the next token is ``ch``: taken (1), or not (0) */
    skip_ws(c);
    if (c->p < c->end && *c->p == ch) {
        c->p++;
        return 1;
    }
    return 0;
}

/* a JSON string's bytes between its quotes; ``*escaped``: it holds a backslash. 0: not a string here */
static int raw_string(Cursor *c, const unsigned char **start, Py_ssize_t *length, int *escaped) {
    skip_ws(c);
    if (c->p >= c->end || *c->p != '"') return 0;
    *start = ++c->p;
    *escaped = 0;
    while (c->p < c->end && *c->p != '"') {
        if (*c->p < 0x20) return 0;  /* a raw control character: JSON refuses it */
        if (*c->p == '\\') {
            *escaped = 1;
            if (++c->p >= c->end) return 0;
        }
        c->p++;
    }
    if (c->p >= c->end) return 0;
    *length = c->p - *start;
    c->p++;
    return 1;
}

/* whether a str holds a lone surrogate (only a JSON escape spells one: strict UTF-8 refuses it written raw) */
static int has_surrogate(PyObject *text) {
    int kind = PyUnicode_KIND(text);
    if (kind == PyUnicode_1BYTE_KIND) return 0;
    const void *data = PyUnicode_DATA(text);
    for (Py_ssize_t k = 0, n = PyUnicode_GET_LENGTH(text); k < n; k++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, k);
        if (c >= 0xD800 && c <= 0xDFFF) return 1;
    }
    return 0;
}

/* the str a JSON string stands for: decoded as UTF-8 (strict), or by ``loads`` (json.loads) where it holds
   escapes; NULL (no error: the caller declines) for anything else, a lone surrogate escape included (the
   Python parse refuses it, as the safetensors library does) */
static PyObject *string_value(const unsigned char *start, Py_ssize_t length, int escaped, PyObject *loads) {
    PyObject *value;
    if (!escaped) {
        value = PyUnicode_DecodeUTF8((const char *)start, length, "strict");
    } else {
        /* decoded as the whole header is (strict UTF-8: json.loads of bytes would let surrogates through) */
        PyObject *quoted = PyUnicode_DecodeUTF8((const char *)start - 1, length + 2, "strict");
        value = quoted ? PyObject_CallOneArg(loads, quoted) : NULL;
        Py_XDECREF(quoted);
        if (value != NULL && (!PyUnicode_CheckExact(value) || has_surrogate(value))) Py_CLEAR(value);
    }
    if (value == NULL) PyErr_Clear();
    return value;
}

/* a JSON number that is an int in [0, 2^63) written as JSON writes one (no sign, no leading zero, no
   fraction or exponent): 1, else 0 */
static int count_value(Cursor *c, int64_t *out) {
    skip_ws(c);
    const unsigned char *s = c->p;
    if (s >= c->end || *s < '0' || *s > '9' || (*s == '0' && s + 1 < c->end && s[1] >= '0' && s[1] <= '9')) return 0;
    int64_t v = 0;
    while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
        if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, (int64_t)(*c->p - '0'), &v)) return 0;
        c->p++;
    }
    if (c->p < c->end && (*c->p == '.' || *c->p == 'e' || *c->p == 'E' || *c->p == '-' || *c->p == '+')) return 0;
    *out = v;
    return 1;
}

static int is_key(const unsigned char *start, Py_ssize_t length, int escaped, const char *name) {
    return !escaped && (size_t)length == strlen(name) && memcmp(start, name, (size_t)length) == 0;
}

PyDoc_STRVAR(parse_header_doc,
"parse_header(raw, path, data_start, file_size, constants) -> (tensors, metadata) or None\n\n"
"A safetensors header's bytes, parsed: what json.loads of them, __metadata__ taken out, then\n"
"ckptool.formats.safetensors._each_tensor give (the TensorRefs by name in the header's order, and the\n"
"metadata), for a header all of whose entries those accept; None for any other (the Python path then\n"
"parses it, and says why it refuses it). ``constants``: (ByteRange, StorageRef, TensorRef, the allowed\n"
"dtypes by name, contiguous_stride, \"cpu\", json.loads for the strings that hold escapes).");

static PyObject *parse_header(PyObject *self, PyObject *args) {
    Py_buffer raw;
    PyObject *path, *constants;
    long long data_start, file_size;
    if (!PyArg_ParseTuple(args, "y*OLLO!:parse_header", &raw, &path, &data_start, &file_size, &PyTuple_Type,
                          &constants))
        return NULL;
    if (PyTuple_GET_SIZE(constants) != 7 || !PyDict_Check(item(constants, 3))) {
        PyBuffer_Release(&raw);
        PyErr_SetString(PyExc_ValueError, "parse_header: malformed constants");
        return NULL;
    }
    PyObject *kinds = item(constants, 3), *loads = item(constants, 6);
    /* a header names few dtypes and shapes for many tensors: each spelling's dtype and item size, and each shape's
       tuple and contiguous strides, made once (the tuples shared, as contiguous_stride's cache shares strides) */
    struct { const unsigned char *text; Py_ssize_t length; PyObject *dtype; int64_t itemsize; } dtype_memo[8];
    int dtype_memos = 0;
    struct { int ndims; int64_t dims[8]; PyObject *shape, *stride; } shape_memo[16];
    int shape_memos = 0;
    Cursor c = {(const unsigned char *)raw.buf, (const unsigned char *)raw.buf + raw.len};
    PyObject *tensors = PyDict_New(), *metadata = NULL, *result = NULL;
    Py_ssize_t n = 0, cap = 1024;
    Span *spans = PyMem_Malloc(sizeof(Span) * (size_t)cap);
    int failed = tensors == NULL || spans == NULL ? -1 : 0;  /* 1: declined */
    if (!failed && (!take(&c, '{') || take(&c, '}'))) failed = 1;  /* (an empty header: the Python path) */
    Py_ssize_t turns = 0;
    while (!failed) {
        const unsigned char *key;
        Py_ssize_t key_length;
        int key_escaped;
        if (signalled(++turns)) {
            failed = -1;
            break;
        }
        if (!raw_string(&c, &key, &key_length, &key_escaped) || !take(&c, ':')) {
            failed = 1;
            break;
        }
        if (is_key(key, key_length, key_escaped, "__metadata__")) {
            if (metadata != NULL || !take(&c, '{') || (metadata = PyDict_New()) == NULL) {
                failed = metadata == NULL && PyErr_Occurred() ? -1 : 1;
                break;
            }
            if (!take(&c, '}')) {
                do {
                    const unsigned char *k, *v;
                    Py_ssize_t kl, vl;
                    int ke, ve;
                    if (signalled(++turns)) {
                        failed = -1;
                        break;
                    }
                    if (!raw_string(&c, &k, &kl, &ke) || !take(&c, ':') || !raw_string(&c, &v, &vl, &ve)) {
                        failed = 1;
                        break;
                    }
                    PyObject *mk = string_value(k, kl, ke, loads), *mv = mk ? string_value(v, vl, ve, loads) : NULL;
                    int present = mv ? PyDict_Contains(metadata, mk) : 1;
                    if (present || PyDict_SetItem(metadata, mk, mv) < 0) failed = present < 0 || PyErr_Occurred() ? -1 : 1;
                    Py_XDECREF(mk);
                    Py_XDECREF(mv);
                } while (!failed && take(&c, ','));
                if (!failed && !take(&c, '}')) failed = 1;
            }
        } else {
            PyObject *name = string_value(key, key_length, key_escaped, loads), *dtype = NULL;
            int64_t dims[64], begin = -1, end = -1, itemsize = 0;
            int ndims = -1, have_offsets = 0;
            /* a key that escapes "__metadata__" (\u005f_metadata__) is the metadata to json.loads and to the
               safetensors library, not a tensor: the Python parse reads it */
            if (name == NULL || (key_escaped && PyUnicode_CompareWithASCIIString(name, "__metadata__") == 0) ||
                !take(&c, '{'))
                failed = 1;
            for (int field = 0; field < 3 && !failed; field++) {
                const unsigned char *f;
                Py_ssize_t fl;
                int fe;
                if ((field && !take(&c, ',')) || !raw_string(&c, &f, &fl, &fe) || !take(&c, ':')) {
                    failed = 1;
                } else if (is_key(f, fl, fe, "dtype") && dtype == NULL) {
                    const unsigned char *d;
                    Py_ssize_t dl;
                    int de;
                    if (!raw_string(&c, &d, &dl, &de)) {
                        failed = 1;
                        continue;
                    }
                    for (int k = 0; k < dtype_memos && !de; k++)
                        if (dtype_memo[k].length == dl && memcmp(dtype_memo[k].text, d, (size_t)dl) == 0) {
                            dtype = dtype_memo[k].dtype;  /* borrowed from ``kinds`` */
                            itemsize = dtype_memo[k].itemsize;
                            break;
                        }
                    if (dtype != NULL) continue;
                    PyObject *text = string_value(d, dl, de, loads);
                    dtype = text ? PyDict_GetItemWithError(kinds, text) : NULL;  /* borrowed */
                    Py_XDECREF(text);
                    if (dtype == NULL) {
                        failed = PyErr_Occurred() ? -1 : 1;
                        continue;
                    }
                    PyObject *itemsize_obj = PyObject_GetAttr(dtype, S_ITEMSIZE);
                    if (itemsize_obj == NULL) {
                        failed = -1;
                        continue;
                    }
                    itemsize = count_of(itemsize_obj);
                    Py_DECREF(itemsize_obj);
                    if (itemsize <= 0) failed = 1;
                    else if (!de && dtype_memos < 8) {
                        dtype_memo[dtype_memos].text = d;
                        dtype_memo[dtype_memos].length = dl;
                        dtype_memo[dtype_memos].dtype = dtype;
                        dtype_memo[dtype_memos].itemsize = itemsize;
                        dtype_memos++;
                    }
                } else if (is_key(f, fl, fe, "shape") && ndims < 0) {
                    if (!take(&c, '[')) failed = 1;
                    else if (take(&c, ']')) ndims = 0;
                    else {
                        ndims = 0;
                        do {
                            if (ndims == 64 || !count_value(&c, &dims[ndims])) failed = 1;
                            else ndims++;
                        } while (!failed && take(&c, ','));
                        if (!failed && !take(&c, ']')) failed = 1;
                    }
                } else if (is_key(f, fl, fe, "data_offsets") && !have_offsets) {
                    have_offsets = take(&c, '[') && count_value(&c, &begin) && take(&c, ',') && count_value(&c, &end) &&
                                   take(&c, ']');
                    if (!have_offsets) failed = 1;
                } else {
                    failed = 1;  /* another key, or one twice */
                }
            }
            if (!failed && !take(&c, '}')) failed = 1;
            int64_t numel = 1, nbytes = 0, start = 0;
            if (!failed) {
                for (int k = 0; k < ndims; k++)  /* (a 0 anywhere: 0, however large the others) */
                    if (dims[k] == 0) numel = 0;
                for (int k = 0; k < ndims && !failed && numel; k++)
                    if (__builtin_mul_overflow(numel, dims[k], &numel)) failed = 1;
                if (!failed && (__builtin_mul_overflow(numel, itemsize, &nbytes) || end - begin != nbytes ||
                                __builtin_add_overflow(begin, (int64_t)data_start, &start)))
                    failed = 1;
            }
            if (!failed && n == cap) {
                Span *more = PyMem_Realloc(spans, sizeof(Span) * (size_t)(cap *= 2));
                if (more == NULL) failed = -1;
                else spans = more;
            }
            if (!failed) {
                spans[n].begin = begin;
                spans[n].end = end;
                n++;
                PyObject *shape = NULL, *stride = NULL;
                for (int k = 0; k < shape_memos && shape == NULL; k++)
                    if (shape_memo[k].ndims == ndims && memcmp(shape_memo[k].dims, dims, sizeof(int64_t) * (size_t)ndims) == 0) {
                        shape = Py_NewRef(shape_memo[k].shape);
                        stride = Py_NewRef(shape_memo[k].stride);
                    }
                if (shape == NULL) {
                    shape = PyTuple_New(ndims);
                    for (int k = 0; shape != NULL && k < ndims; k++) {
                        PyObject *size = PyLong_FromLongLong(dims[k]);
                        if (size == NULL) Py_CLEAR(shape);
                        else PyTuple_SET_ITEM(shape, k, size);
                    }
                    /* C-order strides (contiguous_stride's), in Python where a product passes int64 (a 0 dim ahead) */
                    int64_t running = 1;
                    int wide = 0;
                    stride = shape == NULL ? NULL : PyTuple_New(ndims);
                    for (int k = ndims - 1; stride != NULL && k >= 0 && !wide; k--) {
                        PyObject *step = PyLong_FromLongLong(running);
                        if (step == NULL) Py_CLEAR(stride);
                        else PyTuple_SET_ITEM(stride, k, step);
                        if (k > 0 && __builtin_mul_overflow(running, dims[k], &running)) wide = 1;
                    }
                    if (wide) {
                        Py_CLEAR(stride);
                        stride = PyObject_CallOneArg(item(constants, 4), shape);
                    }
                    if (shape != NULL && stride != NULL && ndims <= 8 && shape_memos < 16) {
                        shape_memo[shape_memos].ndims = ndims;
                        memcpy(shape_memo[shape_memos].dims, dims, sizeof(int64_t) * (size_t)ndims);
                        shape_memo[shape_memos].shape = Py_NewRef(shape);
                        shape_memo[shape_memos].stride = Py_NewRef(stride);
                        shape_memos++;
                    }
                }
                int added = shape == NULL || stride == NULL ? -1 :
                    add_header_tensor(tensors, name, dtype, shape, stride, numel, start, nbytes, path, constants);
                if (added) failed = added;
                Py_XDECREF(shape);
                Py_XDECREF(stride);
            }
            Py_XDECREF(name);
        }
        if (failed || !take(&c, ',')) break;
    }
    if (!failed && (!take(&c, '}') || (skip_ws(&c), c.p != c.end) || n == 0)) failed = 1;
    if (!failed && !tiled(spans, n, data_start, file_size)) failed = 1;
    for (int k = 0; k < shape_memos; k++) {
        Py_DECREF(shape_memo[k].shape);
        Py_DECREF(shape_memo[k].stride);
    }
    PyMem_Free(spans);
    PyBuffer_Release(&raw);
    if (!failed) {
        if (metadata == NULL) metadata = PyDict_New();
        if (metadata != NULL) result = PyTuple_Pack(2, tensors, metadata);
    } else if (failed > 0) {
        PyErr_Clear();
        result = Py_NewRef(Py_None);
    }
    Py_XDECREF(tensors);
    Py_XDECREF(metadata);
    return result;
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS, load_doc},
    {"register", register_maker, METH_VARARGS, register_doc},
    {"parse_header", parse_header, METH_VARARGS, parse_header_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fastload_module = {
    PyModuleDef_HEAD_INIT, "_fastload",
    "The restricted unpickler's run over torch's usual opcodes, with its per-tensor callbacks, and the "
    "safetensors header's parse, in C (ckptool.pickles.unpickle, ckptool.formats.safetensors).", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastload(void) {
    if (S_STORAGE == NULL) {
        S_STORAGE = PyUnicode_InternFromString("storage");
        S_DTYPE = PyUnicode_InternFromString("dtype");
        S_NUMEL = PyUnicode_InternFromString("numel");
        S_ITEMSIZE = PyUnicode_InternFromString("itemsize");
        S_NAME = PyUnicode_InternFromString("name");
        S_MODULE = PyUnicode_InternFromString("module");
        S_DICT = PyUnicode_InternFromString("__dict__");
        S_SETSTATE = PyUnicode_InternFromString("__setstate__");
        if (S_STORAGE == NULL || S_DTYPE == NULL || S_NUMEL == NULL || S_ITEMSIZE == NULL || S_NAME == NULL ||
            S_MODULE == NULL || S_DICT == NULL || S_SETSTATE == NULL)
            return NULL;
    }
    return PyModule_Create(&fastload_module);
}

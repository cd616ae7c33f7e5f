/* The per-record loops of ckptool.formats.zipio, in C.
 *
 * Each function here is the exact equivalent of a Python loop in zipio.py, which stays the
 * reference (and the fallback where this module is not built, or CKPTOOL_PURE_PYTHON=1):
 *
 *   records        _records_py        the central directory's records (zipfile's reading of them)
 *   local_headers  _local_headers_py  each local header's name + extra length, read a window at a time
 *   members        _members_py        the Member tuples of a local archive, and why others are not placed
 *   fold           _fold_py           Members' dicts: by exact name, by ASCII-folded name, the folded names shared
 *   spans          _spans_py          the encryption, stored-size and overlap checks of _read_members
 *   local_headers_for   _headers_for_py          the local headers ZipWriter.add_copies writes
 *   central_directory   _central_directory_py    the central directory ZipWriter.close writes
 *   gather         copying.DataOut._copy_run's reads: a run of small pieces read in windows, in one buffer
 *
 * The bytes are the attacker's: every read is bounds-checked against the buffer, every sum of
 * offsets and lengths is checked for overflow. Where an input is outside what a function handles
 * in C (a value past 64 bits, an object of an unexpected type: never from a file, only from an
 * unusual caller) it returns NotImplemented and the Python loop runs instead; that is how the two
 * stay equal for every input without this file reproducing Python's arbitrary-precision integers.
 * Nothing here calls back into Python except the handle's seek and read; only gather's reads release the GIL.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CENTRAL_SIZE 46    /* zipfile.sizeCentralDir */
#define LOCAL_SIZE 30      /* zipfile.sizeFileHeader */
#define LOCAL_SIG 0x04034B50u
#define CENTRAL_SIG 0x02014B50u
#define PADDING_ID 0x4246u  /* "FB": the extra field torch's writer pads a member's data to alignment with */
#define UTF8_FLAG 0x800u
#define ZIP64_ID 0x0001u
#define MAX_HEADER_LENGTHS 131070  /* a local header's name + extra length: two 16-bit fields */
#define MAX_FILE_SIZE ((long long)1 << 62)  /* no sum of two offsets or lengths under it passes 64 bits */

/* Every 2^16 turns of a loop whose length an input sets, a pending signal's Python handler runs (Ctrl-C raises
 * KeyboardInterrupt, SIGTERM ckptool's exit) and its error ends the loop as any error does: a command ends
 * within a second however many records an archive holds (1: the handler raised, its error set) */
#define SIGNAL_TURNS 0xFFFF
static inline int
signalled(Py_ssize_t turn)
{
    return (turn & SIGNAL_TURNS) == SIGNAL_TURNS && PyErr_CheckSignals() < 0;
}

static Py_UCS4 cp437_table[256];  /* Python's own cp437 codec, read once at import */
static int cp437_ascii_identity;  /* whether it maps 0x00-0x7F to themselves (it does) */

static inline uint32_t
u16(const unsigned char *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8);
}

static inline uint32_t
u32(const unsigned char *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline uint64_t
u64(const unsigned char *p)
{
    return (uint64_t)u32(p) | ((uint64_t)u32(p + 4) << 32);
}

static PyObject *
not_implemented(void)
{
    Py_RETURN_NOTIMPLEMENTED;
}

/* ------------------------------------------------------------------------------------------ */
/* records */

/* bytes.decode("cp437") of n bytes */
static PyObject *
decode_cp437(const unsigned char *s, Py_ssize_t n)
{
    unsigned char any = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        any |= s[i];
    }
    if (any < 0x80 && cp437_ascii_identity) {
        return PyUnicode_DecodeASCII((const char *)s, n, NULL);
    }
    Py_UCS4 *text = PyMem_Malloc((size_t)n * sizeof(Py_UCS4));  /* n > 0 here, at most 65535 */
    if (text == NULL) {
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        text[i] = cp437_table[s[i]];
    }
    PyObject *result = PyUnicode_FromKindAndData(PyUnicode_4BYTE_KIND, text, n);  /* made compact */
    PyMem_Free(text);
    return result;
}

/* zipfile.ZipInfo._decodeExtra (zipio._decode_extra): 0 where it raises */
static int
decode_extra(const unsigned char *extra, uint64_t length, uint64_t *file_size, uint64_t *compress_size,
             uint64_t *header_offset)
{
    while (length >= 4) {
        uint32_t kind = u16(extra), size = u16(extra + 2);
        if ((uint64_t)size + 4 > length) {
            return 0;
        }
        if (kind == ZIP64_ID) {
            const unsigned char *data = extra + 4;
            uint64_t left = size;
            if (*file_size == UINT64_MAX || *file_size == 0xFFFFFFFFu) {
                if (left < 8) {
                    return 0;
                }
                *file_size = u64(data);
                data += 8;
                left -= 8;
            }
            if (*compress_size == 0xFFFFFFFFu) {
                if (left < 8) {
                    return 0;
                }
                *compress_size = u64(data);
                data += 8;
                left -= 8;
            }
            if (*header_offset == 0xFFFFFFFFu) {
                if (left < 8) {
                    return 0;
                }
                *header_offset = u64(data);
            }
        }
        extra += (uint64_t)size + 4;
        length -= (uint64_t)size + 4;
    }
    return 1;
}

/* records(data: bytes, size_cd: int, concat: int, max_version: int) -> list | None | NotImplemented */
static PyObject *
zf_records(PyObject *module, PyObject *args)
{
    PyObject *data, *size_cd_obj, *concat;
    int max_version;
    if (!PyArg_ParseTuple(args, "OOOi:records", &data, &size_cd_obj, &concat, &max_version)) {
        return NULL;
    }
    if (!PyBytes_CheckExact(data) || !PyLong_CheckExact(size_cd_obj) || !PyLong_CheckExact(concat)) {
        return not_implemented();
    }
    uint64_t size_cd = PyLong_AsUnsignedLongLong(size_cd_obj);
    if (size_cd == (uint64_t)-1 && PyErr_Occurred()) {  /* negative or past 64 bits: never from an end record */
        PyErr_Clear();
        return not_implemented();
    }
    int overflow;
    long long concat_value = PyLong_AsLongLongAndOverflow(concat, &overflow);
    if (concat_value == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int no_concat = !overflow && concat_value == 0;

    const unsigned char *buffer = (const unsigned char *)PyBytes_AS_STRING(data);
    uint64_t end = (uint64_t)PyBytes_GET_SIZE(data);
    PyObject *records = PyList_New(0);
    if (records == NULL) {
        return NULL;
    }
    /* total never passes end + 46 + 3 * 65535: each record starts within the buffer */
    uint64_t total = 0;
    Py_ssize_t turns = 0;
    while (total < size_cd) {
        if (signalled(++turns)) {
            goto error;
        }
        if (total + CENTRAL_SIZE > end) {
            goto refused;
        }
        const unsigned char *p = buffer + total;
        if (memcmp(p, "PK\001\002", 4) != 0 || (int)p[6] > max_version) {
            goto refused;
        }
        uint32_t flags = u16(p + 8), method = u16(p + 10), crc = u32(p + 16);
        uint64_t compress_size = u32(p + 20), file_size = u32(p + 24), header_offset = u32(p + 42);
        uint32_t name_length = u16(p + 28), extra_length = u16(p + 30), comment_length = u16(p + 32);
        uint64_t at = total + CENTRAL_SIZE;  /* <= end */
        uint64_t name_end = at + name_length < end ? at + name_length : end;
        PyObject *raw = PyBytes_FromStringAndSize((const char *)buffer + at, (Py_ssize_t)(name_end - at));
        if (raw == NULL) {
            goto error;
        }
        PyObject *name = flags & UTF8_FLAG
            ? PyUnicode_DecodeUTF8((const char *)buffer + at, (Py_ssize_t)(name_end - at), NULL)
            : decode_cp437(buffer + at, (Py_ssize_t)(name_end - at));
        if (name == NULL) {
            Py_DECREF(raw);
            if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                PyErr_Clear();
                goto refused;
            }
            goto error;
        }
        if (extra_length) {
            uint64_t extra_start = name_end;  /* = min(at + name_length, end) */
            uint64_t extra_end = at + name_length + extra_length < end ? at + name_length + extra_length : end;
            if (!decode_extra(buffer + extra_start, extra_end - extra_start, &file_size, &compress_size,
                              &header_offset)) {
                Py_DECREF(raw);
                Py_DECREF(name);
                goto refused;
            }
        }
        Py_ssize_t null = PyUnicode_FindChar(name, 0, 0, PyUnicode_GET_LENGTH(name), 1);
        if (null == -2) {
            Py_DECREF(raw);
            Py_DECREF(name);
            goto error;
        }
        if (null >= 0) {
            PyObject *cut = PyUnicode_Substring(name, 0, null);
            Py_DECREF(name);
            if (cut == NULL) {
                Py_DECREF(raw);
                goto error;
            }
            name = cut;
        }
        PyObject *record = PyTuple_New(8);
        if (record == NULL) {
            Py_DECREF(raw);
            Py_DECREF(name);
            goto error;
        }
        PyTuple_SET_ITEM(record, 0, name);
        PyTuple_SET_ITEM(record, 1, raw);
        PyObject *offset = PyLong_FromUnsignedLongLong(header_offset);
        if (offset != NULL && !no_concat) {
            Py_SETREF(offset, PyNumber_Add(offset, concat));  /* header_offset + concat, any size */
        }
        PyTuple_SET_ITEM(record, 2, offset);
        uint64_t fields[5] = {file_size, compress_size, crc, flags, method};
        int failed = offset == NULL;
        for (int i = 0; i < 5 && !failed; i++) {  /* a field left NULL is skipped by the tuple's deallocation */
            PyObject *value = PyLong_FromUnsignedLongLong(fields[i]);
            PyTuple_SET_ITEM(record, 3 + i, value);
            failed = value == NULL;
        }
        if (failed || PyList_Append(records, record) < 0) {
            Py_DECREF(record);
            goto error;
        }
        Py_DECREF(record);
        total += CENTRAL_SIZE + (uint64_t)name_length + extra_length + comment_length;
    }
    return records;

refused:
    Py_DECREF(records);
    Py_RETURN_NONE;
error:
    Py_DECREF(records);
    return NULL;
}

/* a Python int as a C long long; *state: 0 it fits, -1 below, +1 above; -2 not an int (a subclass
 * of int is not: its arithmetic may be its own) */
static long long
as_int64(PyObject *value, int *state)
{
    if (!PyLong_CheckExact(value)) {
        *state = -2;
        return 0;
    }
    int overflow;
    long long result = PyLong_AsLongLongAndOverflow(value, &overflow);  /* cannot fail on an int */
    *state = overflow;
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* local_headers */

typedef struct {
    long long offset;
    Py_ssize_t index;
} placed_t;

static int
compare_placed(const void *a, const void *b)
{
    const placed_t *x = a, *y = b;
    if (x->offset != y->offset) {
        return x->offset < y->offset ? -1 : 1;
    }
    return x->index < y->index ? -1 : x->index > y->index;
}

/* local_headers(handle, offsets: list, file_size: int, window: int) -> list | NotImplemented */
static PyObject *
zf_local_headers(PyObject *module, PyObject *args)
{
    PyObject *handle, *offsets, *file_size_obj, *window_obj;
    if (!PyArg_ParseTuple(args, "OOOO:local_headers", &handle, &offsets, &file_size_obj, &window_obj)) {
        return NULL;
    }
    if (!PyList_Check(offsets)) {
        return not_implemented();
    }
    int state_size, state_window;
    long long file_size = as_int64(file_size_obj, &state_size), window = as_int64(window_obj, &state_window);
    if (state_size != 0 || state_window != 0 || file_size < 0 || file_size > MAX_FILE_SIZE || window < 0
        || window > MAX_FILE_SIZE) {
        return not_implemented();
    }
    Py_ssize_t count = PyList_GET_SIZE(offsets);
    placed_t *order = PyMem_Malloc(count ? (size_t)count * sizeof(placed_t) : 1);
    if (order == NULL) {
        return PyErr_NoMemory();
    }
    PyObject *results = NULL;
    Py_ssize_t placed = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(offsets, i);
        if (signalled(i)) {
            goto error;
        }
        if (!PyLong_CheckExact(item)) {
            PyMem_Free(order);
            return not_implemented();
        }
        int overflow;
        long long offset = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (offset == -1 && PyErr_Occurred()) {
            goto error;
        }
        /* past 64 bits either way: negative, or past the end of a file under 2**62 bytes */
        if (!overflow && offset >= 0 && offset <= file_size - LOCAL_SIZE) {
            order[placed].offset = offset;
            order[placed].index = i;
            placed++;
        }
    }
    qsort(order, (size_t)placed, sizeof(placed_t), compare_placed);
    results = PyList_New(count);
    if (results == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_INCREF(Py_None);
        PyList_SET_ITEM(results, i, Py_None);
    }
    Py_ssize_t k = 0, windows = 0;
    while (k < placed) {
        if (signalled(++windows)) {
            goto error;
        }
        long long start = order[k].offset;
        Py_ssize_t last = k;
        while (last + 1 < placed && order[last + 1].offset + LOCAL_SIZE - start <= window) {
            last++;
        }
        PyObject *moved = PyObject_CallMethod(handle, "seek", "L", start);
        if (moved == NULL) {
            goto error;
        }
        Py_DECREF(moved);
        PyObject *read = PyObject_CallMethod(handle, "read", "L", order[last].offset + LOCAL_SIZE - start);
        if (read == NULL) {
            goto error;
        }
        if (!PyBytes_CheckExact(read)) {  /* the Python loop reads (and judges) it again */
            Py_DECREF(read);
            Py_DECREF(results);
            PyMem_Free(order);
            return not_implemented();
        }
        const unsigned char *bytes = (const unsigned char *)PyBytes_AS_STRING(read);
        long long length = (long long)PyBytes_GET_SIZE(read);
        for (Py_ssize_t j = k; j <= last; j++) {
            long long at = order[j].offset - start;
            if (at + LOCAL_SIZE > length || u32(bytes + at) != LOCAL_SIG) {
                continue;
            }
            PyObject *lengths = PyLong_FromUnsignedLong(u16(bytes + at + 26) + u16(bytes + at + 28));
            if (lengths == NULL) {
                Py_DECREF(read);
                goto error;
            }
            PyObject *none = PyList_GET_ITEM(results, order[j].index);
            PyList_SET_ITEM(results, order[j].index, lengths);
            Py_DECREF(none);
        }
        Py_DECREF(read);
        k = last + 1;
    }
    PyMem_Free(order);
    return results;

error:
    Py_XDECREF(results);
    PyMem_Free(order);
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* members */

static PyObject *
problem(long kind, PyObject *name)
{
    return Py_BuildValue("(lO)", kind, name);
}

/* members(records: list, headers: list, file_size: int, Member: type) -> (found, problems) | NotImplemented
 * problems: (0, name) lies outside the file, (1, name) no local header, (2, name) ends past the end */
static PyObject *
zf_members(PyObject *module, PyObject *args)
{
    PyObject *records, *headers, *file_size_obj;
    PyTypeObject *member_type;
    if (!PyArg_ParseTuple(args, "OOOO!:members", &records, &headers, &file_size_obj, &PyType_Type, &member_type)) {
        return NULL;
    }
    if (!PyList_Check(records) || !PyList_Check(headers)) {
        return not_implemented();
    }
    Py_ssize_t count = PyList_GET_SIZE(records);
    int state_size;
    long long file_size = as_int64(file_size_obj, &state_size);
    if (state_size != 0 || file_size < 0 || file_size > MAX_FILE_SIZE || PyList_GET_SIZE(headers) != count
        || !PyType_IsSubtype(member_type, &PyTuple_Type)) {
        return not_implemented();
    }
    /* every value is read before any Member is made: an input outside the C loop leaves nothing made */
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *record = PyList_GET_ITEM(records, i);
        PyObject *header = PyList_GET_ITEM(headers, i);
        if (signalled(i)) {
            return NULL;
        }
        if (!PyTuple_CheckExact(record) || PyTuple_GET_SIZE(record) != 8) {
            return not_implemented();
        }
        for (int field = 2; field < 8; field++) {
            if (!PyLong_CheckExact(PyTuple_GET_ITEM(record, field))) {
                return not_implemented();
            }
        }
        if (header != Py_None) {
            int state;
            long long lengths = as_int64(header, &state);
            if (state != 0 || lengths < 0 || lengths > MAX_HEADER_LENGTHS) {
                return not_implemented();
            }
        }
    }
    PyObject *found = PyList_New(0), *problems = PyList_New(0);
    if (found == NULL || problems == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (signalled(i)) {
            goto error;
        }
        PyObject *record = PyList_GET_ITEM(records, i);
        PyObject *name = PyTuple_GET_ITEM(record, 0), *raw_name = PyTuple_GET_ITEM(record, 1);
        PyObject *header_offset = PyTuple_GET_ITEM(record, 2), *size = PyTuple_GET_ITEM(record, 3);
        PyObject *stored_size = PyTuple_GET_ITEM(record, 4), *crc = PyTuple_GET_ITEM(record, 5);
        PyObject *flags = PyTuple_GET_ITEM(record, 6), *method = PyTuple_GET_ITEM(record, 7);
        PyObject *header = PyList_GET_ITEM(headers, i);
        int state;
        long long offset = as_int64(header_offset, &state);
        long kind = -1;
        long long data_offset = 0;
        /* header_offset < 0 or header_offset + 30 > file_size (past 64 bits: one or the other) */
        if (state != 0 || offset < 0 || offset > file_size - LOCAL_SIZE) {
            kind = 0;
        } else if (header == Py_None) {
            kind = 1;
        } else {
            data_offset = offset + LOCAL_SIZE + PyLong_AsLongLong(header);  /* < 2**62 + 2**17 */
            long long stored = as_int64(stored_size, &state), end;
            /* data_offset + stored_size > file_size: above 64 bits it is; below, it is not */
            if (state > 0 || (state == 0 && (__builtin_add_overflow(data_offset, stored, &end) || end > file_size))) {
                kind = 2;
            }
        }
        if (kind >= 0) {
            PyObject *entry = problem(kind, name);
            if (entry == NULL || PyList_Append(problems, entry) < 0) {
                Py_XDECREF(entry);
                goto error;
            }
            Py_DECREF(entry);
            continue;
        }
        long long method_value = as_int64(method, &state);
        int compressed = state != 0 || method_value != 0;  /* method != ZIP_STORED */
        long long flag_bits = as_int64(flags, &state);
        PyObject *encrypted;
        if (state == 0) {
            encrypted = flag_bits & 1 ? Py_True : Py_False;  /* two's complement, as Python's & */
            Py_INCREF(encrypted);
        } else {  /* bool(flags & 0x1) past 64 bits */
            PyObject *bit = PyLong_FromLong(1), *masked = bit ? PyNumber_And(flags, bit) : NULL;
            Py_XDECREF(bit);
            int truth = masked ? PyObject_IsTrue(masked) : -1;
            Py_XDECREF(masked);
            if (truth < 0) {
                goto error;
            }
            encrypted = truth ? Py_True : Py_False;
            Py_INCREF(encrypted);
        }
        PyObject *placed = PyLong_FromLongLong(data_offset);
        PyObject *member = placed ? member_type->tp_alloc(member_type, 10) : NULL;
        if (member == NULL) {
            Py_XDECREF(placed);
            Py_DECREF(encrypted);
            goto error;
        }
        PyObject *compressed_obj = compressed ? Py_True : Py_False;
        Py_INCREF(compressed_obj);
        PyObject *items[10] = {name, placed, size, crc, compressed_obj, stored_size, header_offset, encrypted,
                               method, raw_name};
        for (int field = 0; field < 10; field++) {
            if (field != 1 && field != 4 && field != 7) {  /* the references made above are handed over */
                Py_INCREF(items[field]);
            }
            PyTuple_SET_ITEM(member, field, items[field]);
        }
        if (PyList_Append(found, member) < 0) {
            Py_DECREF(member);
            goto error;
        }
        Py_DECREF(member);
    }
    return Py_BuildValue("(NN)", found, problems);

error:
    Py_XDECREF(found);
    Py_XDECREF(problems);
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* fold */

/* name.lower() if name.isascii() else name.translate(_ASCII_LOWER): ASCII letters lowered, nothing else */
static PyObject *
ascii_lower(PyObject *name)
{
    Py_ssize_t length = PyUnicode_GET_LENGTH(name);
    int kind = PyUnicode_KIND(name);
    const void *data = PyUnicode_DATA(name);
    Py_ssize_t first = 0;
    while (first < length) {
        Py_UCS4 c = PyUnicode_READ(kind, data, first);
        if (c >= 'A' && c <= 'Z') {
            break;
        }
        first++;
    }
    if (first == length) {
        Py_INCREF(name);
        return name;
    }
    /* the same kind: lowering ASCII letters leaves the widest character, so the string stays canonical */
    PyObject *folded = PyUnicode_New(length, PyUnicode_MAX_CHAR_VALUE(name));
    if (folded == NULL) {
        return NULL;
    }
    void *out = PyUnicode_DATA(folded);
    memcpy(out, data, (size_t)length * (size_t)kind);
    for (Py_ssize_t i = first; i < length; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, out, i);
        if (c >= 'A' && c <= 'Z') {
            PyUnicode_WRITE(kind, out, i, c + ('a' - 'A'));
        }
    }
    return folded;
}

/* fold(by_name: dict, entries: list, Member: type, folded: dict, shared: set) -> None | NotImplemented */
static PyObject *
zf_fold(PyObject *module, PyObject *args)
{
    PyObject *by_name, *entries, *folded, *shared;
    PyTypeObject *member_type;
    if (!PyArg_ParseTuple(args, "OOO!OO:fold", &by_name, &entries, &PyType_Type, &member_type, &folded, &shared)) {
        return NULL;
    }
    if (!PyDict_Check(by_name) || !PyList_Check(entries) || !PyDict_CheckExact(folded) || !PySet_CheckExact(shared)
        || !PyType_IsSubtype(member_type, &PyTuple_Type)) {
        return not_implemented();
    }
    Py_ssize_t count = PyList_GET_SIZE(entries);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *member = PyList_GET_ITEM(entries, i);
        if (signalled(i)) {
            return NULL;
        }
        if (Py_TYPE(member) != member_type || PyTuple_GET_SIZE(member) < 1
            || !PyUnicode_CheckExact(PyTuple_GET_ITEM(member, 0))) {
            return not_implemented();
        }
    }
    /* one pass, then the other, as the Python loops run: the entries list is not changed between them */
    Py_ssize_t before = PyDict_GET_SIZE(by_name);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *member = PyList_GET_ITEM(entries, i);
        if (signalled(i) || PyDict_SetItem(by_name, PyTuple_GET_ITEM(member, 0), member) < 0) {
            return NULL;
        }
    }
    /* the usual archive: names all ASCII without a capital, none twice. Each folds to itself and is its own
       first member: ``folded`` is ``by_name`` (its table copied whole, no lowered name made) */
    int plain = before == 0 && PyDict_GET_SIZE(by_name) == count && PyDict_GET_SIZE(folded) == 0;
    for (Py_ssize_t i = 0; plain && i < count; i++) {
        PyObject *name = PyTuple_GET_ITEM(PyList_GET_ITEM(entries, i), 0);
        if (!PyUnicode_IS_ASCII(name)) {
            plain = 0;
            break;
        }
        const Py_UCS1 *text = PyUnicode_1BYTE_DATA(name);
        for (Py_ssize_t k = 0, n = PyUnicode_GET_LENGTH(name); k < n; k++) {
            if (text[k] >= 'A' && text[k] <= 'Z') {
                plain = 0;
                break;
            }
        }
    }
    if (plain) {
        if (PyDict_Update(folded, by_name) < 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *member = PyList_GET_ITEM(entries, i);
        if (signalled(i)) {
            return NULL;
        }
        PyObject *key = ascii_lower(PyTuple_GET_ITEM(member, 0));
        if (key == NULL) {
            return NULL;
        }
        PyObject *first = PyDict_SetDefault(folded, key, member);  /* borrowed */
        if (first == NULL || (first != member && PySet_Add(shared, key) < 0)) {
            Py_DECREF(key);
            return NULL;
        }
        Py_DECREF(key);
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------ */
/* spans */

typedef struct {
    long long start;  /* the header offset */
    long long end;
    PyObject *name;   /* borrowed from its Member */
} span_t;

static int
compare_spans(const void *a, const void *b)
{
    const span_t *x = a, *y = b;
    if (x->start != y->start) {
        return x->start < y->start ? -1 : 1;
    }
    if (x->end != y->end) {
        return x->end < y->end ? -1 : 1;
    }
    /* two str: cannot fail. Equal names (and offsets) are interchangeable in what is reported */
    return PyUnicode_Compare(x->name, y->name);
}

/* spans(entries: list, Member: type, directory_start: int, not_read: int) -> None | tuple | NotImplemented
 * tuple: (0, name) encrypted, (1, name, size, stored_size) a stored size lie, (2, previous, name) overlap,
 * (3, name) overlaps the central directory: the first refusal the Python loops raise */
static PyObject *
zf_spans(PyObject *module, PyObject *args)
{
    PyObject *entries, *directory_start_obj, *not_read_obj;
    PyTypeObject *member_type;
    if (!PyArg_ParseTuple(args, "OO!OO:spans", &entries, &PyType_Type, &member_type, &directory_start_obj,
                          &not_read_obj)) {
        return NULL;
    }
    if (!PyList_Check(entries)) {
        return not_implemented();
    }
    int state_start, state_not_read;
    long long directory_start = as_int64(directory_start_obj, &state_start);
    long long not_read = as_int64(not_read_obj, &state_not_read);
    if (state_start != 0 || state_not_read != 0 || !PyType_IsSubtype(member_type, &PyTuple_Type)) {
        return not_implemented();
    }
    Py_ssize_t count = PyList_GET_SIZE(entries);
    span_t *spans = PyMem_Malloc(count ? (size_t)count * sizeof(span_t) : 1);
    if (spans == NULL) {
        return PyErr_NoMemory();
    }
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *member = PyList_GET_ITEM(entries, i);
        if (signalled(i)) {
            goto done;  /* (result NULL: the handler's error) */
        }
        if (Py_TYPE(member) != member_type || PyTuple_GET_SIZE(member) != 10) {
            goto in_python;
        }
        PyObject *name = PyTuple_GET_ITEM(member, 0), *data_offset = PyTuple_GET_ITEM(member, 1);
        PyObject *size = PyTuple_GET_ITEM(member, 2), *compressed = PyTuple_GET_ITEM(member, 4);
        PyObject *stored_size = PyTuple_GET_ITEM(member, 5), *header_offset = PyTuple_GET_ITEM(member, 6);
        PyObject *encrypted = PyTuple_GET_ITEM(member, 7);
        if (!PyUnicode_CheckExact(name) || !PyBool_Check(encrypted) || !PyBool_Check(compressed)
            || !PyLong_CheckExact(size) || !PyLong_CheckExact(stored_size)) {
            goto in_python;
        }
        if (encrypted == Py_True) {
            result = Py_BuildValue("(iO)", 0, name);
            goto done;
        }
        if (compressed == Py_False) {
            int differ = PyObject_RichCompareBool(stored_size, size, Py_NE);  /* two ints */
            if (differ < 0) {
                goto done;
            }
            if (differ) {
                result = Py_BuildValue("(iOOO)", 1, name, size, stored_size);
                goto done;
            }
        }
        int state;
        long long offset = as_int64(header_offset, &state), start, end;
        if (state != 0) {
            goto in_python;
        }
        long long placed = as_int64(data_offset, &state);
        if (state != 0) {
            goto in_python;
        }
        long long stored = as_int64(stored_size, &state);
        if (state != 0) {
            goto in_python;
        }
        if (placed != not_read) {
            start = placed;
        } else if (__builtin_add_overflow(offset, (long long)LOCAL_SIZE, &start)) {
            goto in_python;
        }
        if (__builtin_add_overflow(start, stored, &end)) {
            goto in_python;
        }
        spans[i].start = offset;
        spans[i].end = end;
        spans[i].name = name;
    }
    qsort(spans, (size_t)count, sizeof(span_t), compare_spans);
    for (Py_ssize_t i = 1; i < count; i++) {
        if (spans[i].start < spans[i - 1].end) {
            result = Py_BuildValue("(iOO)", 2, spans[i - 1].name, spans[i].name);
            goto done;
        }
    }
    if (count && spans[count - 1].end > directory_start) {
        result = Py_BuildValue("(iO)", 3, spans[count - 1].name);
        goto done;
    }
    Py_INCREF(Py_None);
    result = Py_None;
    goto done;

in_python:
    Py_INCREF(Py_NotImplemented);
    result = Py_NotImplemented;
done:
    PyMem_Free(spans);
    return result;
}

/* ------------------------------------------------------------------------------------------ */

/* ------------------------------------------------------------------ ZipWriter's headers and directory */

static void le16(unsigned char *p, uint32_t v) { p[0] = (unsigned char)v; p[1] = (unsigned char)(v >> 8); }
static void le32(unsigned char *p, uint32_t v) { for (int k = 0; k < 4; k++) p[k] = (unsigned char)(v >> (8 * k)); }
static void le64(unsigned char *p, uint64_t v) { for (int k = 0; k < 8; k++) p[k] = (unsigned char)(v >> (8 * k)); }

/* an exact int in [0, limit]: 1 and *out set, else 0 */
static int bounded(PyObject *v, uint64_t limit, uint64_t *out) {
    int state;
    long long x = as_int64(v, &state);
    if (state != 0 || x < 0 || (uint64_t)x > limit) return 0;
    *out = (uint64_t)x;
    return 1;
}

/* what a local header (from its offset 4) and a central record (from 6) both hold, in the same order: the
   version needed, flags (UTF-8 names), method (stored), time, date, CRC, both sizes, the name's and extra's lengths */
static void put_member_fields(unsigned char *p, int zip64, uint32_t crc, uint32_t stored, Py_ssize_t name_length,
                              Py_ssize_t extra_length) {
    le16(p, zip64 ? 45 : 20);
    le16(p + 2, UTF8_FLAG);
    le16(p + 4, 0);
    le16(p + 6, 0);
    le16(p + 8, 0x21);
    le32(p + 10, crc);
    le32(p + 14, stored);
    le32(p + 18, stored);
    le16(p + 22, (uint32_t)name_length);
    le16(p + 24, (uint32_t)extra_length);
}

/* local_headers_for(names, sizes, crcs, position, alignment) -> (headers, encoded, offsets, end) or NotImplemented
 *
 * zipio._headers_for_py (ZipWriter.add_copies' loop): for each member, its name's UTF-8, the local header written where the archive
 * stands (zip64 past 4 GiB, the data padded to ``alignment`` with torch's "FB" extra field), where that header
 * starts, and where the last member's data ends. */
static PyObject *zf_local_headers_for(PyObject *self, PyObject *args) {
    PyObject *names, *sizes, *crcs;
    long long start_position;
    Py_ssize_t alignment;
    if (!PyArg_ParseTuple(args, "O!O!O!Ln:local_headers_for", &PyList_Type, &names, &PyList_Type, &sizes,
                          &PyList_Type, &crcs, &start_position, &alignment))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(names);
    if (PyList_GET_SIZE(sizes) != n || PyList_GET_SIZE(crcs) != n || alignment < 8 || alignment > 4096 ||
        start_position < 0)
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *headers = PyList_New(n), *encoded = PyList_New(n), *offsets = PyList_New(n);
    if (headers == NULL || encoded == NULL || offsets == NULL) goto fail;
    uint64_t position = (uint64_t)start_position;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (signalled(i)) goto fail;
        PyObject *name = PyList_GET_ITEM(names, i);
        uint64_t size, crc;
        if (!PyUnicode_CheckExact(name) || !bounded(PyList_GET_ITEM(sizes, i), (uint64_t)INT64_MAX, &size) ||
            !bounded(PyList_GET_ITEM(crcs, i), 0xFFFFFFFFu, &crc))
            goto decline;
        PyObject *raw = PyUnicode_AsUTF8String(name);
        if (raw == NULL) {
            PyErr_Clear();
            goto decline;
        }
        PyList_SET_ITEM(encoded, i, raw);
        Py_ssize_t name_length = PyBytes_GET_SIZE(raw);
        int zip64 = size >= 0xFFFFFFFFu;
        Py_ssize_t extra = zip64 ? 20 : 0;
        uint64_t data_start = position + LOCAL_SIZE + (uint64_t)name_length + (uint64_t)extra;
        int padded = data_start % (uint64_t)alignment != 0;  /* then padded after a 4-byte field header */
        Py_ssize_t padding = padded ? (Py_ssize_t)(((uint64_t)alignment - (data_start + 4) % (uint64_t)alignment) %
                                                   (uint64_t)alignment) : 0;
        Py_ssize_t extra_length = extra + (padded ? 4 + padding : 0);
        if (name_length > 0xFFFF || extra_length > 0xFFFF) goto decline;
        PyObject *header = PyBytes_FromStringAndSize(NULL, LOCAL_SIZE + name_length + extra_length);
        if (header == NULL) goto fail;
        unsigned char *h = (unsigned char *)PyBytes_AS_STRING(header);
        le32(h, LOCAL_SIG);
        put_member_fields(h + 4, zip64, (uint32_t)crc, zip64 ? 0xFFFFFFFFu : (uint32_t)size, name_length, extra_length);
        memcpy(h + LOCAL_SIZE, PyBytes_AS_STRING(raw), (size_t)name_length);
        unsigned char *e = h + LOCAL_SIZE + name_length;
        if (zip64) {
            le16(e, ZIP64_ID);
            le16(e + 2, 16);
            le64(e + 4, size);
            le64(e + 12, size);
            e += 20;
        }
        if (padded) {
            le16(e, PADDING_ID);
            le16(e + 2, (uint32_t)padding);
            memset(e + 4, 'Z', (size_t)padding);
        }
        PyList_SET_ITEM(headers, i, header);
        PyObject *offset = PyLong_FromUnsignedLongLong(position);
        if (offset == NULL) goto fail;
        PyList_SET_ITEM(offsets, i, offset);
        position += (uint64_t)PyBytes_GET_SIZE(header) + size;
        if (position > (uint64_t)INT64_MAX) goto decline;
    }
    PyObject *result = Py_BuildValue("(NNNK)", headers, encoded, offsets, (unsigned long long)position);
    return result;
decline:
    Py_XDECREF(headers);
    Py_XDECREF(encoded);
    Py_XDECREF(offsets);
    Py_RETURN_NOTIMPLEMENTED;
fail:
    Py_XDECREF(headers);
    Py_XDECREF(encoded);
    Py_XDECREF(offsets);
    return NULL;
}

/* central_directory(entries) -> (records, zip64) or NotImplemented
 *
 * zipio._central_directory_py (ZipWriter.close's loop): the central directory's records of ``entries`` ((name bytes, header offset, size, crc)
 * each) end to end, and whether any needed a zip64 extra field. */
static PyObject *zf_central_directory(PyObject *self, PyObject *args) {
    PyObject *entries;
    if (!PyArg_ParseTuple(args, "O!:central_directory", &PyList_Type, &entries)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(entries);
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = PyList_GET_ITEM(entries, i);
        if (signalled(i)) return NULL;
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 4 || !PyBytes_CheckExact(PyTuple_GET_ITEM(entry, 0)) ||
            PyBytes_GET_SIZE(PyTuple_GET_ITEM(entry, 0)) > 0xFFFF)
            Py_RETURN_NOTIMPLEMENTED;
        total += CENTRAL_SIZE + (size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(entry, 0)) + 28;  /* (at most: the extra's 3 values) */
    }
    PyObject *records = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (records == NULL) return NULL;
    unsigned char *h = (unsigned char *)PyBytes_AS_STRING(records);
    int zip64 = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = PyList_GET_ITEM(entries, i), *name = PyTuple_GET_ITEM(entry, 0);
        uint64_t offset, size, crc;
        if (signalled(i)) {
            Py_DECREF(records);
            return NULL;
        }
        if (!bounded(PyTuple_GET_ITEM(entry, 1), (uint64_t)INT64_MAX, &offset) ||
            !bounded(PyTuple_GET_ITEM(entry, 2), (uint64_t)INT64_MAX, &size) ||
            !bounded(PyTuple_GET_ITEM(entry, 3), 0xFFFFFFFFu, &crc)) {
            Py_DECREF(records);
            Py_RETURN_NOTIMPLEMENTED;
        }
        uint64_t values[3];
        int count = 0;
        if (size >= 0xFFFFFFFFu) {
            values[count++] = size;
            values[count++] = size;
        }
        if (offset >= 0xFFFFFFFFu) values[count++] = offset;
        Py_ssize_t name_length = PyBytes_GET_SIZE(name), extra_length = count ? 4 + 8 * count : 0;
        zip64 |= count > 0;
        le32(h, CENTRAL_SIG);
        le16(h + 4, count ? 45 : 20);  /* version made by */
        put_member_fields(h + 6, count > 0, (uint32_t)crc, size >= 0xFFFFFFFFu ? 0xFFFFFFFFu : (uint32_t)size,
                          name_length, extra_length);
        le16(h + 32, 0);  /* comment length, disk, attributes */
        le16(h + 34, 0);
        le16(h + 36, 0);
        le32(h + 38, 0);
        le32(h + 42, offset >= 0xFFFFFFFFu ? 0xFFFFFFFFu : (uint32_t)offset);
        memcpy(h + CENTRAL_SIZE, PyBytes_AS_STRING(name), (size_t)name_length);
        unsigned char *e = h + CENTRAL_SIZE + name_length;
        if (count) {
            le16(e, ZIP64_ID);
            le16(e + 2, (uint32_t)(8 * count));
            for (int k = 0; k < count; k++) le64(e + 4 + 8 * k, values[k]);
        }
        h = e + extra_length;
    }
    Py_ssize_t used = (Py_ssize_t)(h - (unsigned char *)PyBytes_AS_STRING(records));
    if (_PyBytes_Resize(&records, used) < 0) return NULL;
    return Py_BuildValue("(NO)", records, zip64 ? Py_True : Py_False);
}

/* ------------------------------------------------------------------ copying.DataOut._copy_run's reads */

typedef struct {
    int64_t offset;
    Py_ssize_t index;
} Piece;

static int by_offset(const void *a, const void *b) {
    int64_t x = ((const Piece *)a)->offset, y = ((const Piece *)b)->offset;
    return x < y ? -1 : x > y;
}

/* ``count`` int64s of a list of exact non-negative ints (0), or 1 where one is anything else */
static int int64_list(PyObject *list, int64_t *out, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t value;
        if (!bounded(PyList_GET_ITEM(list, i), (uint64_t)INT64_MAX, &value)) return 1;
        out[i] = (int64_t)value;
    }
    return 0;
}

/* gather(fd, offsets, sizes, headers, gap, ahead) -> bytes, None or NotImplemented
 *
 * The bytes a run of small pieces makes in the output: for each i, headers[i] (if headers is not None)
 * then sizes[i] bytes of fd at offsets[i]. The file is read in windows taken in the order the pieces lie
 * in it, each window once (a piece within ``gap`` bytes of the last, ``ahead`` bytes at most), the GIL
 * released. None where a read fails or the file ends first (the Python run then reads it, and says
 * why); NotImplemented for a value no file gives (the Python run then copies it). */
static PyObject *zf_gather(PyObject *self, PyObject *args) {
    int fd;
    PyObject *offsets, *sizes, *headers;
    Py_ssize_t gap, ahead;
    if (!PyArg_ParseTuple(args, "iO!O!Onn:gather", &fd, &PyList_Type, &offsets, &PyList_Type, &sizes, &headers,
                          &gap, &ahead))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(offsets);
    if (PyList_GET_SIZE(sizes) != n || gap < 0 || ahead < 1 ||
        (headers != Py_None && (!PyList_CheckExact(headers) || PyList_GET_SIZE(headers) != n)))
        Py_RETURN_NOTIMPLEMENTED;
    int64_t *off = PyMem_Malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    int64_t *size = PyMem_Malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    int64_t *pos = PyMem_Malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    Piece *order = PyMem_Malloc(sizeof(Piece) * (size_t)(n ? n : 1));
    PyObject *result = NULL;
    char *buffer = NULL;
    int declined = 0;
    if (off == NULL || size == NULL || pos == NULL || order == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (int64_list(offsets, off, n) || int64_list(sizes, size, n)) {
        declined = 1;
        goto done;
    }
    int64_t total = 0, largest = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (signalled(i)) goto done;  /* (result NULL: the handler's error) */
        if (headers != Py_None) {
            PyObject *header = PyList_GET_ITEM(headers, i);
            if (!PyBytes_CheckExact(header) || __builtin_add_overflow(total, (int64_t)PyBytes_GET_SIZE(header), &total)) {
                declined = 1;
                goto done;
            }
        }
        pos[i] = total;
        int64_t last;
        if (__builtin_add_overflow(total, size[i], &total) || __builtin_add_overflow(off[i], size[i], &last)) {
            declined = 1;
            goto done;
        }
        if (size[i] > largest) largest = size[i];
        order[i].offset = off[i];
        order[i].index = i;
    }
    if (total > PY_SSIZE_T_MAX / 2 || largest > PY_SSIZE_T_MAX / 2) {
        declined = 1;
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    int64_t window_bytes = largest > (int64_t)ahead ? largest : (int64_t)ahead;
    buffer = result == NULL ? NULL : PyMem_RawMalloc((size_t)window_bytes);
    if (result == NULL || buffer == NULL) {
        if (result != NULL) PyErr_NoMemory();
        goto done;
    }
    char *out = PyBytes_AS_STRING(result);
    if (headers != Py_None)
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *header = PyList_GET_ITEM(headers, i);
            memcpy(out + pos[i] - PyBytes_GET_SIZE(header), PyBytes_AS_STRING(header), (size_t)PyBytes_GET_SIZE(header));
        }
    qsort(order, (size_t)n, sizeof(Piece), by_offset);
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t k = 0;
    while (k < n && !failed) {
        int64_t start = order[k].offset, end = start + size[order[k].index];
        Py_ssize_t m = k + 1;
        while (m < n) {
            int64_t at = order[m].offset, stop = at + size[order[m].index];
            if (at - end > (int64_t)gap || stop - start > window_bytes) break;
            if (stop > end) end = stop;
            m++;
        }
        int64_t got = 0;
        while (got < end - start) {
            ssize_t r = pread(fd, buffer + got, (size_t)(end - start - got), (off_t)(start + got));
            if (r <= 0) {
                failed = 1;  /* the file ends first, or the read fails */
                break;
            }
            got += r;
        }
        for (Py_ssize_t q = k; q < m && !failed; q++) {
            Py_ssize_t i = order[q].index;
            memcpy(out + pos[i], buffer + (off[i] - start), (size_t)size[i]);
        }
        k = m;
    }
    Py_END_ALLOW_THREADS
    if (failed) {
        Py_CLEAR(result);
        result = Py_NewRef(Py_None);
    }
done:
    PyMem_Free(off);
    PyMem_Free(size);
    PyMem_Free(pos);
    PyMem_Free(order);
    PyMem_RawFree(buffer);
    if (declined) {
        Py_XDECREF(result);
        Py_RETURN_NOTIMPLEMENTED;
    }
    return result;
}

/* starting(names, prefix, every) -> bool | NotImplemented: whether every name (``every``) or any name starts with
   ``prefix``, as all()/any() over map(str.startswith, names, repeat(prefix)) would say; ``names`` a dict (its keys)
   or a list of exact str, else NotImplemented */
static PyObject *
zf_starting(PyObject *module, PyObject *args)
{
    PyObject *names, *prefix;
    int every;
    if (!PyArg_ParseTuple(args, "OUp:starting", &names, &prefix, &every)) {
        return NULL;
    }
    if (!PyDict_Check(names) && !PyList_CheckExact(names)) {
        return not_implemented();
    }
    int dict = PyDict_Check(names);
    Py_ssize_t pos = 0, i = 0;
    PyObject *name, *value;
    for (Py_ssize_t turn = 0;; turn++) {
        if (signalled(turn)) {
            return NULL;
        }
        if (dict) {
            if (!PyDict_Next(names, &pos, &name, &value)) {
                break;
            }
        } else {
            if (i >= PyList_GET_SIZE(names)) {
                break;
            }
            name = PyList_GET_ITEM(names, i++);
        }
        if (!PyUnicode_CheckExact(name)) {
            return not_implemented();
        }
        Py_ssize_t found = PyUnicode_Tailmatch(name, prefix, 0, PY_SSIZE_T_MAX, -1);
        if (found < 0) {
            return NULL;
        }
        if (found != every) {  /* a name that does not (every) or does (any) decides */
            return PyBool_FromLong(!every);
        }
    }
    return PyBool_FromLong(every);
}

static PyMethodDef methods[] = {
    {"records", zf_records, METH_VARARGS,
     "records(data, size_cd, concat, max_version): the central directory's records, as zipio._records_py"},
    {"local_headers", zf_local_headers, METH_VARARGS,
     "local_headers(handle, offsets, file_size, window): as zipio._local_headers_py"},
    {"members", zf_members, METH_VARARGS,
     "members(records, headers, file_size, Member): (found, problems), as zipio._members_py"},
    {"fold", zf_fold, METH_VARARGS,
     "fold(by_name, entries, Member, folded, shared): fills the dicts, as zipio._fold_py"},
    {"local_headers_for", zf_local_headers_for, METH_VARARGS,
     "local_headers_for(names, sizes, crcs, position, alignment): ZipWriter.add_copies' headers, as its loop"},
    {"central_directory", zf_central_directory, METH_VARARGS,
     "central_directory(entries): ZipWriter.close's records and whether one is zip64, as its loop"},
    {"gather", zf_gather, METH_VARARGS,
     "gather(fd, offsets, sizes, headers, gap, ahead): a run of small pieces' output bytes, as copying.DataOut._copy_run"},
    {"starting", zf_starting, METH_VARARGS,
     "starting(names, prefix, every): whether every (or any) name starts with prefix, as all()/any() of str.startswith"},
    {"spans", zf_spans, METH_VARARGS,
     "spans(entries, Member, directory_start, not_read): the first refusal, as zipio._spans_py"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef zipfast_module = {
    PyModuleDef_HEAD_INIT, "_zipfast", "The per-record loops of ckptool.formats.zipio, in C.", -1, methods,
};

PyMODINIT_FUNC
PyInit__zipfast(void)
{
    char every[256];
    for (int i = 0; i < 256; i++) {
        every[i] = (char)i;
    }
    PyObject *table = PyUnicode_Decode(every, 256, "cp437", "strict");
    if (table == NULL) {
        return NULL;
    }
    if (PyUnicode_GET_LENGTH(table) != 256) {
        Py_DECREF(table);
        PyErr_SetString(PyExc_ImportError, "the cp437 codec does not map one character per byte");
        return NULL;
    }
    cp437_ascii_identity = 1;
    for (int i = 0; i < 256; i++) {
        cp437_table[i] = PyUnicode_READ_CHAR(table, i);
        if (i < 0x80 && cp437_table[i] != (Py_UCS4)i) {
            cp437_ascii_identity = 0;
        }
    }
    Py_DECREF(table);
    return PyModule_Create(&zipfast_module);
}

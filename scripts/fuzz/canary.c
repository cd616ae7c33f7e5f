/* A deliberately broken extension: the proof, at every `make fuzz`, that the sanitizers are live.
 *
 * scripts/fuzz/run.py compiles it with the flags of the real extensions, loads it under the same
 * environment, and requires each fault below to end the process with the sanitizer's own report
 * (and the clean call to pass). A flag or an LD_PRELOAD that silently stopped working fails there,
 * before any fuzzing result is trusted.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <string.h>

/* copy(n): n bytes into an 8-byte heap buffer; n > 8 is a heap-buffer-overflow only ASan sees
 * (the write goes through memcpy, which UBSan does not check) */
static PyObject *
copy(PyObject *self, PyObject *arg)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n < 0 && PyErr_Occurred())
        return NULL;
    static const char source[64] = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcde";
    char *buffer = malloc(8);
    if (buffer == NULL)
        return PyErr_NoMemory();
    memcpy(buffer, source, (size_t)n);
    long first = buffer[0];
    free(buffer);
    return PyLong_FromLong(first);
}

/* add(n): n + INT_MAX in int; n > 0 is a signed overflow only UBSan sees */
static PyObject *
add(PyObject *self, PyObject *arg)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    volatile int value = (int)n;
    return PyLong_FromLong(value + INT_MAX);
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_O, NULL},
    {"add", add, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_canary", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__canary(void)
{
    return PyModule_Create(&module);
}

/* A minimal Python extension module, built in several ways by the audit tests:
 *   -DMODNAME=foo                     the PyInit_<MODNAME> it exports
 *   -DPy_LIMITED_API=0x030A0000       limited API only (abi3 for Python >= 3.10)
 *   -DNON_LIMITED                     calls PyInstanceMethod_New and _PyObject_GetDictPtr,
 *                                     which are not in the limited API (pybind11 does)
 *   -DPYBIND11_MARKER                 carries pybind11's internals key, as pybind11 modules do
 *   -DUSE_311                         calls PyType_GetName, limited API only since 3.11
 *                                     (build with -DPy_LIMITED_API=0x030B0000)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define STR2(a) #a
#define STR(a) STR2(a)

#ifdef PYBIND11_MARKER
const char pybind11_internals_key[] = "__pybind11_internals_v11_gcc_libstdcpp_cxxabi1019__";
#endif

static PyObject *answer(PyObject *self, PyObject *arg) {
#ifdef NON_LIMITED
    PyObject *m = PyInstanceMethod_New(arg);
    PyObject **dict = _PyObject_GetDictPtr(arg);
    Py_XDECREF(m);
    return PyLong_FromLong(dict != NULL ? 1 : 42);
#else
#ifdef USE_311
    PyObject *name = PyType_GetName(Py_TYPE(arg));
    Py_XDECREF(name);
#else
    (void)arg;
#endif
    return PyLong_FromLong(42);
#endif
}

static PyMethodDef methods[] = {
    {"answer", answer, METH_O, "42"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, STR(MODNAME), NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC CAT(PyInit_, MODNAME)(void) { return PyModule_Create(&moddef); }

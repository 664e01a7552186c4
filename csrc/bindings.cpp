// The Python module elasticlab._C. It holds no pybind11 bindings: importing it loads the shared
// library, whose static initialisers register the operators with torch (torch.ops.elasticlab.*).
// Avoiding pybind11 here sidesteps the mismatch between torch's bundled pybind11 and PyPI's.
#include <Python.h>

static struct PyModuleDef elasticlab_module = {
    PyModuleDef_HEAD_INIT, "_C",
    "elasticlab compiled kernels, registered as torch.ops.elasticlab.*", -1, nullptr,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&elasticlab_module); }

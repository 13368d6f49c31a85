// A real pybind11 module (pybind11 cannot use the limited API): SOABI-named it passes the
// audit, named .abi3.so it must fail (a limited-API declaration once shipped such a module). -DMODNAME=<name> sets PyInit_<name>.
#include <pybind11/pybind11.h>

PYBIND11_MODULE(MODNAME, m) {
  m.def("add", [](int a, int b) { return a + b; });
}

/* Stands in for libtorch_python.so: exports a C function that is no stable-ABI shim
 * (torch/_C.so imports `initModule` from the real one). */
void initModule(void) {}

/* Links the fake libtorch_python.so (DT_NEEDED) and calls a C function of it that is not a
 * stable shim: UNSTABLE, though nothing it imports is C++. */
void initModule(void);

void torch_c_user_entry(void) { initModule(); }

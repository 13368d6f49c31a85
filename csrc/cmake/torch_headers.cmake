# sm7x_find_torch_headers(<out-var>): torch's include dir for the stable-ABI core, or ""
# when there is none. Only headers are used (never libtorch/libc10), so any torch at or
# above the floor (targets.json torch.min, SM7X_TORCH_MIN) works: a conda libtorch/pytorch
# host package (pass -DSM7X_TORCH_INCLUDE_DIR) or the torch package of the Python
# interpreter (found without importing torch).
function(sm7x_find_torch_headers out)
  set(${out} "" PARENT_SCOPE)
  set(inc "")
  if(SM7X_TORCH_INCLUDE_DIR)
    if(NOT EXISTS "${SM7X_TORCH_INCLUDE_DIR}/torch/csrc/stable/library.h")
      message(FATAL_ERROR "SM7X_TORCH_INCLUDE_DIR=${SM7X_TORCH_INCLUDE_DIR} does not hold "
              "torch/csrc/stable/library.h (headers of torch >= ${SM7X_TORCH_MIN})")
    endif()
    set(inc "${SM7X_TORCH_INCLUDE_DIR}")
    set(how "SM7X_TORCH_INCLUDE_DIR")
  else()
    if(NOT Python_EXECUTABLE)
      find_package(Python 3.10 COMPONENTS Interpreter QUIET)
    endif()
    if(NOT Python_EXECUTABLE)
      return()
    endif()
    # find_spec locates the package without importing it (fast, no CUDA initialisation).
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c
              "import importlib.util as u, os; s = u.find_spec('torch'); print(os.path.join(s.submodule_search_locations[0], 'include') if s else '')"
      OUTPUT_VARIABLE py_inc OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE rc ERROR_QUIET)
    if(NOT rc EQUAL 0 OR NOT py_inc OR NOT EXISTS "${py_inc}/torch/csrc/stable/library.h")
      return()
    endif()
    set(inc "${py_inc}")
    set(how "torch of ${Python_EXECUTABLE}")
  endif()
  # The stable ABI target (SM7X_TORCH_TARGET_VERSION) needs headers of at least that torch.
  set(vh "${inc}/torch/headeronly/version.h")
  if(NOT EXISTS "${vh}")
    message(WARNING "sm7x: ${inc} has no torch/headeronly/version.h: torch < ${SM7X_TORCH_MIN} headers, "
            "not usable for the core ops")
    return()
  endif()
  file(STRINGS "${vh}" major REGEX "#define TORCH_VERSION_MAJOR ")
  file(STRINGS "${vh}" minor REGEX "#define TORCH_VERSION_MINOR ")
  string(REGEX REPLACE ".* ([0-9]+).*" "\\1" major "${major}")
  string(REGEX REPLACE ".* ([0-9]+).*" "\\1" minor "${minor}")
  if("${major}.${minor}" VERSION_LESS "${SM7X_TORCH_MIN}")
    message(WARNING "sm7x: torch headers in ${inc} are version ${major}.${minor}; the core "
            "ops need >= ${SM7X_TORCH_MIN}")
    return()
  endif()
  message(STATUS "sm7x: torch ${major}.${minor} headers: ${inc} (${how})")
  set(${out} "${inc}" PARENT_SCOPE)
endfunction()

# sm7x_find_torch_cpu_library(<out-var> <include-dir>): libtorch_cpu.so, which holds the
# stable-ABI C shims (aoti_torch_* / torch_*). The core library links it only for its
# DT_NEEDED entry: torch.ops.load_library opens libraries RTLD_LOCAL, and torch's own
# libraries are not in the global scope, so an undefined shim would not resolve
# otherwise. At run time the loader finds the libtorch_cpu.so torch already loaded (by
# soname; no RPATH needed). Only C symbols are taken from it (checked in the tests).
function(sm7x_find_torch_cpu_library out inc)
  set(SM7X_TORCH_CPU_LIBRARY "" CACHE FILEPATH
      "libtorch_cpu.so to link the C shims from; empty: <torch include dir>/../lib")
  if(SM7X_TORCH_CPU_LIBRARY)
    set(lib "${SM7X_TORCH_CPU_LIBRARY}")
  else()
    get_filename_component(lib "${inc}/../lib/libtorch_cpu.so" ABSOLUTE)
  endif()
  if(NOT EXISTS "${lib}")
    message(FATAL_ERROR "sm7x: ${lib} not found: the core ops link torch's C shims from "
            "libtorch_cpu.so; set SM7X_TORCH_CPU_LIBRARY to it")
  endif()
  set(${out} "${lib}" PARENT_SCOPE)
endfunction()

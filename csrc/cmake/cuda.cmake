# sm7x_enable_cuda(): enable CUDA when a CUDA compiler is found, and pick the archs.
# A macro, not a function: enable_language() must run at file scope of the top-level
# directory (languages enabled below are not visible to the whole project). Needs
# targets.cmake (which CUDA majors can target which arch: cuda_max_major).
#
# Sets SM7X_CUDA_ENABLED, SM7X_CUDA_ARCHS (cache: "70;75" style list) and
# SM7X_CUDA_ARCHITECTURES (CMake form: SASS for every arch, plus PTX for the highest,
# e.g. "70-real;75"), SM7X_CUDA_RUNTIME (cache: Static or Shared cudart).
macro(sm7x_enable_cuda)
  set(SM7X_CUDA_ENABLED OFF)
  include(CheckLanguage)
  check_language(CUDA)  # honours CUDACXX / -DCMAKE_CUDA_COMPILER, else nvcc on PATH
  if(NOT CMAKE_CUDA_COMPILER)
    message(STATUS "sm7x: no CUDA compiler found: the core ops are built CPU-only "
                   "(set CUDACXX or put nvcc on PATH for the CUDA kernels)")
  else()
    # The default arch list depends on the nvcc version, which CMake only knows after
    # enable_language; ask nvcc first. Default: every arch of targets.json that this nvcc
    # still targets (CUDA 13 dropped sm_70: "70;75" with 12.x, "75" with 13).
    execute_process(COMMAND "${CMAKE_CUDA_COMPILER}" --version
                    OUTPUT_VARIABLE _sm7x_nvcc_out ERROR_QUIET)
    string(REGEX MATCH "release ([0-9]+)\\.([0-9]+)" _sm7x_m "${_sm7x_nvcc_out}")
    set(_sm7x_nvcc_major "${CMAKE_MATCH_1}")
    set(_sm7x_default_archs "")
    sm7x_target_members(_sm7x_targets archs)
    foreach(_t IN LISTS _sm7x_targets)
      sm7x_target_cuda_too_new(_sm7x_why ${_t} "${_sm7x_nvcc_major}")
      if(NOT _sm7x_why)
        sm7x_target_number(_sm7x_n ${_t})
        list(APPEND _sm7x_default_archs ${_sm7x_n})
      endif()
    endforeach()
    list(SORT _sm7x_default_archs COMPARE NATURAL)
    # Each arch of targets.json listed here also gets its FA2 library (SM7X_BUILD_FA2).
    set(SM7X_CUDA_ARCHS "${_sm7x_default_archs}" CACHE STRING
        "CUDA archs (e.g. 70;75): SASS for each, PTX for the highest; FA2 libraries for those of targets.json")
    set(_sm7x_archs ${SM7X_CUDA_ARCHS})
    list(REMOVE_DUPLICATES _sm7x_archs)
    list(SORT _sm7x_archs COMPARE NATURAL)
    foreach(_a IN LISTS _sm7x_archs)
      if(NOT _a MATCHES "^[0-9]+$")
        message(FATAL_ERROR "SM7X_CUDA_ARCHS=${SM7X_CUDA_ARCHS}: '${_a}' is not a plain "
                "compute capability number like 70 or 75")
      endif()
      sm7x_target_of_number(_t ${_a})
      if(_t)
        sm7x_target_cuda_too_new(_sm7x_why ${_t} "${_sm7x_nvcc_major}")
        if(_sm7x_why)
          message(FATAL_ERROR "SM7X_CUDA_ARCHS=${SM7X_CUDA_ARCHS}: CUDA ${_sm7x_nvcc_major} "
                  "(${CMAKE_CUDA_COMPILER}) cannot target sm_${_a}; ${_sm7x_why} "
                  "(python/sm7x/targets.json). Use such a toolchain for sm_${_a}, or leave "
                  "${_a} out of SM7X_CUDA_ARCHS")
        endif()
      endif()
    endforeach()
    list(GET _sm7x_archs -1 _sm7x_top)
    set(SM7X_CUDA_ARCHITECTURES "")
    foreach(_a IN LISTS _sm7x_archs)
      if(_a STREQUAL _sm7x_top)
        list(APPEND SM7X_CUDA_ARCHITECTURES "${_a}")  # SASS + PTX
      else()
        list(APPEND SM7X_CUDA_ARCHITECTURES "${_a}-real")  # SASS only
      endif()
    endforeach()
    # Used by enable_language's compiler check too, so it never tries an arch this nvcc
    # lacks (CMake's own default may be one).
    set(CMAKE_CUDA_ARCHITECTURES "${SM7X_CUDA_ARCHITECTURES}")
    enable_language(CUDA)
    set(SM7X_CUDA_ENABLED ON)
    # Static cudart keeps the library free of a libcudart.so dependency (it must load in
    # a CPU-only torch); toolchains without libcudart_static.a fall back to Shared.
    set(SM7X_CUDA_RUNTIME "Static" CACHE STRING "cudart linkage: Static or Shared")
    set_property(CACHE SM7X_CUDA_RUNTIME PROPERTY STRINGS Static Shared)
    if(SM7X_CUDA_RUNTIME STREQUAL "Static")
      find_file(SM7X_CUDART_STATIC libcudart_static.a
                HINTS ${CMAKE_CUDA_IMPLICIT_LINK_DIRECTORIES} NO_DEFAULT_PATH)
      if(NOT SM7X_CUDART_STATIC)
        message(WARNING "sm7x: libcudart_static.a not found in "
                "${CMAKE_CUDA_IMPLICIT_LINK_DIRECTORIES}; linking cudart shared (the "
                "library then needs libcudart.so at run time)")
        set(SM7X_CUDA_RUNTIME "Shared" CACHE STRING "cudart linkage: Static or Shared" FORCE)
      endif()
    endif()
    message(STATUS "sm7x: CUDA ${CMAKE_CUDA_COMPILER_VERSION} (${CMAKE_CUDA_COMPILER}), "
                   "archs ${SM7X_CUDA_ARCHITECTURES}, cudart ${SM7X_CUDA_RUNTIME}")
  endif()
endmacro()

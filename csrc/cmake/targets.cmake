# The GPU targets of sm7x as CMake reads them from python/sm7x/targets.json, the one place
# they are written: the archs and their compute capability, the newest CUDA major that
# still targets each (cuda_max_major; used by cuda.cmake), and per arch the FA2 head dims
# and tile configs (used by fa2/CMakeLists.txt). Changing the file re-runs the configure.
set(SM7X_TARGETS_JSON "${CMAKE_CURRENT_LIST_DIR}/../../python/sm7x/targets.json" CACHE
    FILEPATH "the GPU targets table (archs, toolchain limits, FA2 kernel configs)")
if(NOT EXISTS "${SM7X_TARGETS_JSON}")
  message(FATAL_ERROR "sm7x: ${SM7X_TARGETS_JSON} not found (SM7X_TARGETS_JSON): the "
          "build reads the archs and FA2 kernel configs from it")
endif()
file(READ "${SM7X_TARGETS_JSON}" SM7X_TARGETS)
set_property(DIRECTORY "${CMAKE_CURRENT_SOURCE_DIR}" APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
             "${SM7X_TARGETS_JSON}")

# sm7x_target_get(<out> <path>...): the value at a path of targets.json; "" for a missing
# member or null.
function(sm7x_target_get out)
  string(JSON type ERROR_VARIABLE err TYPE "${SM7X_TARGETS}" ${ARGN})
  if(err OR type STREQUAL "NULL")
    set(${out} "" PARENT_SCOPE)
  else()
    string(JSON value GET "${SM7X_TARGETS}" ${ARGN})
    set(${out} "${value}" PARENT_SCOPE)
  endif()
endfunction()

# sm7x_target_members(<out> <path>...): the member names of an object of targets.json, or
# the indices of an array ("" when it is missing or empty).
function(sm7x_target_members out)
  set(names "")
  string(JSON type ERROR_VARIABLE err TYPE "${SM7X_TARGETS}" ${ARGN})
  if(NOT err)
    string(JSON n LENGTH "${SM7X_TARGETS}" ${ARGN})
    if(n GREATER 0)
      math(EXPR last "${n} - 1")
      foreach(i RANGE ${last})
        if(type STREQUAL "ARRAY")
          list(APPEND names ${i})
        else()
          string(JSON name MEMBER "${SM7X_TARGETS}" ${ARGN} ${i})
          list(APPEND names "${name}")
        endif()
      endforeach()
    endif()
  endif()
  set(${out} "${names}" PARENT_SCOPE)
endfunction()

# sm7x_target_number(<out> <arch>): the CMake/nvcc arch number of an arch ("sm75" -> 75).
function(sm7x_target_number out arch)
  sm7x_target_get(cap archs ${arch} capability)
  string(REPLACE "." "" number "${cap}")
  set(${out} "${number}" PARENT_SCOPE)
endfunction()

# sm7x_target_of_number(<out> <number>): the arch of targets.json with that arch number, or "".
function(sm7x_target_of_number out number)
  set(${out} "" PARENT_SCOPE)
  sm7x_target_members(archs archs)
  foreach(arch IN LISTS archs)
    sm7x_target_number(n ${arch})
    if(n STREQUAL "${number}")
      set(${out} "${arch}" PARENT_SCOPE)
    endif()
  endforeach()
endfunction()

# sm7x_target_cuda_too_new(<out> <arch> <nvcc-major>): why nvcc <nvcc-major> cannot target
# <arch> (the arch's why_cuda_max_major), or "" when it can.
function(sm7x_target_cuda_too_new out arch nvcc_major)
  set(${out} "" PARENT_SCOPE)
  sm7x_target_get(max archs ${arch} cuda_max_major)
  if(NOT max STREQUAL "" AND nvcc_major AND nvcc_major GREATER max)
    sm7x_target_get(why archs ${arch} why_cuda_max_major)
    set(${out} "it needs CUDA <= ${max}.x: ${why}" PARENT_SCOPE)
  endif()
endfunction()

# The torch floor (targets.json torch.min, e.g. "2.10") and the stable-ABI macro value it
# gives: TORCH_TARGET_VERSION is major << 56 | minor << 48 (torch/headeronly/version.h).
string(JSON SM7X_TORCH_MIN GET "${SM7X_TARGETS}" torch min)
if(NOT SM7X_TORCH_MIN MATCHES "^([0-9]+)\\.([0-9]+)$")
  message(FATAL_ERROR "sm7x: targets.json torch.min must be MAJOR.MINOR, not '${SM7X_TORCH_MIN}'")
endif()
math(EXPR _sm7x_torch_target "(${CMAKE_MATCH_1} << 56) | (${CMAKE_MATCH_2} << 48)" OUTPUT_FORMAT HEXADECIMAL)
set(SM7X_TORCH_TARGET_VERSION "${_sm7x_torch_target}")

# sm7x_reproducible(<target>...): the same sources compile to the same bytes in any build
# directory, at any time (the packages are checked: python -m sm7x_tools.repro check).
# Needs _sm7x_repo_root (the top-level CMakeLists.txt, which also maps the source and torch
# header paths out of __FILE__ with -ffile-prefix-map).
#
# - gcc: -frandom-seed from the source's path, gcc's own switch for identical objects (the
#   names it would draw at random, e.g. of LTO sections; LTO itself stays off: ext/).
# - nvcc: cudafe++ names anonymous namespaces _GLOBAL__N__<hash of the source's absolute
#   path>_..., which reach the symbols and the fatbin; --orig_src_path_name gives it the
#   path relative to the repository instead (one per file: the names stay unique). Its
#   temporaries are named after the object (-objtemp), not tmpxft_<pid>_..., a name the
#   host object's symbol table keeps.
#
# The path is relative to the repository, or for a generated file (the FA2 instantiations)
# to the build directory.
function(sm7x_reproducible)
  foreach(target IN LISTS ARGN)
    get_target_property(sources ${target} SOURCES)
    get_target_property(dir ${target} SOURCE_DIR)
    foreach(src IN LISTS sources)
      get_filename_component(abs "${src}" ABSOLUTE BASE_DIR "${dir}")
      cmake_path(IS_PREFIX CMAKE_BINARY_DIR "${abs}" NORMALIZE generated)
      if(generated)
        file(RELATIVE_PATH rel "${CMAKE_BINARY_DIR}" "${abs}")
        set(rel "build/${rel}")
      else()
        file(RELATIVE_PATH rel "${_sm7x_repo_root}" "${abs}")
      endif()
      if(abs MATCHES "\\.cu$")
        set(opts "-Xcudafe=--orig_src_path_name=${rel}" "-Xcompiler=-frandom-seed=${rel}")
      else()
        set(opts "-frandom-seed=${rel}")
      endif()
      # a source compiled into two targets of one directory (fa2's ops.cpp) is set once
      get_property(have SOURCE "${abs}" TARGET_DIRECTORY ${target} PROPERTY COMPILE_OPTIONS)
      if(NOT "-frandom-seed=${rel}" IN_LIST have AND NOT "-Xcompiler=-frandom-seed=${rel}" IN_LIST have)
        set_property(SOURCE "${abs}" TARGET_DIRECTORY ${target} APPEND PROPERTY COMPILE_OPTIONS ${opts})
      endif()
    endforeach()
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-objtemp>)
  endforeach()
endfunction()

# nvcc reads this next to itself; $(_HERE_) is that directory, so the environment can
# live anywhere (conda-forge's layout: nvvm/ and targets/x86_64-linux/ beside bin/).
TOP                = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
PATH              += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES          += "-I$(TOP)/targets/x86_64-linux/include" $(_SPACE_)
LIBRARIES         =+ $(_SPACE_) "-L$(TOP)/targets/x86_64-linux/lib/stubs" "-L$(TOP)/targets/x86_64-linux/lib"
CUDAFE_FLAGS      +=
PTXAS_FLAGS       +=

/* Found first (-isystem) by the g++ wrapper when it builds against a sysroot: the real
   header, then off with what an older sysroot's glibc lacks. This machine's libstdc++
   headers were configured against its own glibc; conda-forge's are configured against the
   sysroot's, which turns these off itself: pthread_cond_clockwait and the *_clocklock
   functions came in glibc 2.30. (A wrapper header rather than -include: nvcc compiles its
   already-preprocessed host code again, where a forced include would come twice.) */
#include_next <bits/c++config.h>
#if !__GLIBC_PREREQ(2, 30)
#undef _GLIBCXX_USE_PTHREAD_COND_CLOCKWAIT
#undef _GLIBCXX_USE_PTHREAD_MUTEX_CLOCKLOCK
#undef _GLIBCXX_USE_PTHREAD_RWLOCK_CLOCKLOCK
#endif

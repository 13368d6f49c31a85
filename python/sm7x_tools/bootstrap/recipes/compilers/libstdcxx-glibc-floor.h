/* Force-included by the g++ wrapper when it builds against a sysroot. This machine's
   libstdc++ headers were configured against its own glibc; conda-forge's are configured
   against the sysroot's. Turn off what an older sysroot's glibc lacks, as its configure
   would have: pthread_cond_clockwait and the *_clocklock functions came in glibc 2.30. */
#ifdef __cplusplus
#include <bits/c++config.h>
#if !__GLIBC_PREREQ(2, 30)
#undef _GLIBCXX_USE_PTHREAD_COND_CLOCKWAIT
#undef _GLIBCXX_USE_PTHREAD_MUTEX_CLOCKLOCK
#undef _GLIBCXX_USE_PTHREAD_RWLOCK_CLOCKLOCK
#endif
#endif

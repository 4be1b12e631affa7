/* A box whose wall clock is off by SKEW_SECONDS (LD_PRELOAD): CLOCK_REALTIME and what derives from it are
   shifted; the monotonic clocks are not, as on a real machine whose clock drifted or was set wrong. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static long long skew_ns(void) {
    static long long v;
    static int ready;
    if (!ready) {
        const char *s = getenv("SKEW_SECONDS");
        v = s ? atoll(s) * 1000000000LL : 0;
        ready = 1;
    }
    return v;
}

int clock_gettime(clockid_t clk, struct timespec *tp) {
    static int (*real)(clockid_t, struct timespec *);
    if (!real) real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int r = real(clk, tp);
    if (r == 0 && (clk == CLOCK_REALTIME || clk == CLOCK_REALTIME_COARSE)) {
        long long ns = (long long)tp->tv_sec * 1000000000LL + tp->tv_nsec + skew_ns();
        tp->tv_sec = ns / 1000000000LL;
        tp->tv_nsec = ns % 1000000000LL;
    }
    return r;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    int r = clock_gettime(CLOCK_REALTIME, &ts);
    (void)tz;
    if (tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return r;
}

time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t) *t = ts.tv_sec;
    return ts.tv_sec;
}

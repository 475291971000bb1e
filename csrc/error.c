/* error.c -- filling toast_error. */
#include <stdarg.h>
#include <stdio.h>

#include "toast_core.h"

toast_status toast_set_error(toast_error *err, toast_status code, int arg,
                             const char *fmt, ...)
{
    if (err != NULL) {
        va_list ap;
        err->code = code;
        err->arg = arg;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return code;
}

/* The device timeline's stage hot path, compiled: what the engine thread runs per stage.
 *
 * instrument/device_timeline.py's StageSite.stage and _StageScope.__exit__ are ~20 us of Python
 * a decode step on the H200's hosts (five stages); this module is the same logic in C
 * (docs/design.md section 4.3, "The compiled stage core"). instrument/native.py builds it and
 * DeviceTimeline(core="auto") uses it when it is built and current; the Python classes stay
 * the reference and the fallback, and tests run the engine both ways.
 *
 *   Core  the hot state of one DeviceTimeline: the stage recorded last, the count of stages
 *         recorded, the drop threshold, the event pool, how events are made and recorded
 *         (optionally a cuEventRecord pointer called directly, the GIL kept), and the two
 *         callbacks of the rare paths (_bounded, _drop_oldest), which stay in Python.
 *   Site  StageSite: name, lane, stream, constant args, the stream's queue; stage() opens one.
 *   Scope / DerivedScope  _StageScope / _DerivedScope: one stage, its own pending record; the
 *         poll (Python) reads the same attribute names.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <time.h>

#ifndef STAGECORE_SOURCE_HASH
#define STAGECORE_SOURCE_HASH "unknown"
#endif

/* One field of an X-macro list of a type's object fields (its traverse and clear). */
#define VISIT_FIELD(f) Py_VISIT(self->f);
#define CLEAR_FIELD(f) Py_CLEAR(self->f);
/* A type's tp_traverse and tp_clear, from its list of object fields. */
#define GC_FUNCTIONS(prefix, Type, FIELDS) \
    static int prefix##_traverse(Type *self, visitproc visit, void *arg) \
    { \
        FIELDS(VISIT_FIELD) \
        return 0; \
    } \
    static int prefix##_clear(Type *self) \
    { \
        FIELDS(CLEAR_FIELD) \
        return 0; \
    }
/* ... and its tp_dealloc, for a type without weak references. */
#define PLAIN_DEALLOC(prefix, Type) \
    static void prefix##_dealloc(Type *self) \
    { \
        PyObject_GC_UnTrack(self); \
        prefix##_clear(self); \
        Py_TYPE(self)->tp_free((PyObject *)self); \
    }

typedef int (*record_fn_t)(void *event, void *stream);
typedef int (*elapsed_fn_t)(float *ms, void *start, void *end);

static PyObject *str_enabled, *str_known, *str_cuda_event, *str_cuda_stream, *str_untraced_gap;
static PyObject *str_after, *str_contiguous, *str_args, *str_end, *str_key, *str_end_ns;

static inline long long
monotonic_ns(void)
{
    /* time.monotonic_ns: the one host clock of every trace (instrument.tracer.now_ns). */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ------------------------------------------------------------------------------------------ */
/* Core                                                                                        */

typedef struct {
    PyObject_HEAD
    PyObject *tracer;      /* its .enabled is read per stage */
    PyObject *last;        /* the stage recorded last (a Scope), or None */
    long long num_recorded;
    long long drop_above;  /* an exit drops the oldest pending stage past this */
    char derive;           /* derived begins: stamp host_begin_ns, maybe no begin record */
    char record_begins;
    PyObject *free;        /* list: pooled events (popped from the end) */
    PyObject *new_event;   /* callable() -> a fresh event */
    PyObject *record;      /* callable(event, stream) */
    PyObject *bounded;     /* callable(queue, last) -> bool */
    PyObject *drop_oldest; /* callable(queue) */
    PyObject *error_cls;   /* raised when record_fn fails */
    unsigned long long record_fn; /* address of cuEventRecord (or a stand-in); 0: use record */
    long long direct_records;     /* records made through record_fn */
    /* The once-per-step hooks' fast paths (the rest stays in Python: the slow_* callables). */
    long long num_emitted, num_dropped, poll_batch, max_deferred;
    PyObject *lent;              /* dict: id(end event) -> its stage, lent to the caller */
    PyObject *returned_append;   /* the given-back lent events' deque.append */
    PyObject *spare_append;      /* the untraced sync events' list.append */
    PyObject *slow_poll_if_due, *slow_poll_while_waiting, *slow_event_after_stage;
} Core;

/* The object fields of Core: traversed and cleared from this one list. */
#define CORE_OBJECTS(X) \
    X(tracer) \
    X(last) \
    X(free) \
    X(new_event) \
    X(record) \
    X(bounded) \
    X(drop_oldest) \
    X(error_cls) \
    X(lent) \
    X(returned_append) \
    X(spare_append) \
    X(slow_poll_if_due) \
    X(slow_poll_while_waiting) \
    X(slow_event_after_stage)

GC_FUNCTIONS(core, Core, CORE_OBJECTS)
PLAIN_DEALLOC(core, Core)

static PyObject *
core_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Core *self = (Core *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(Py_None);
    self->last = Py_None;
    return (PyObject *)self;
}

static PyMemberDef core_members[] = {
    {"tracer", T_OBJECT, offsetof(Core, tracer), 0, NULL},
    {"num_recorded", T_LONGLONG, offsetof(Core, num_recorded), 0, NULL},
    {"drop_above", T_LONGLONG, offsetof(Core, drop_above), 0, NULL},
    {"derive", T_BOOL, offsetof(Core, derive), 0, NULL},
    {"record_begins", T_BOOL, offsetof(Core, record_begins), 0, NULL},
    {"free", T_OBJECT, offsetof(Core, free), 0, NULL},
    {"new_event", T_OBJECT, offsetof(Core, new_event), 0, NULL},
    {"record", T_OBJECT, offsetof(Core, record), 0, NULL},
    {"bounded", T_OBJECT, offsetof(Core, bounded), 0, NULL},
    {"drop_oldest", T_OBJECT, offsetof(Core, drop_oldest), 0, NULL},
    {"error_cls", T_OBJECT, offsetof(Core, error_cls), 0, NULL},
    {"record_fn", T_ULONGLONG, offsetof(Core, record_fn), 0, NULL},
    {"direct_records", T_LONGLONG, offsetof(Core, direct_records), 0, NULL},
    {"num_emitted", T_LONGLONG, offsetof(Core, num_emitted), 0, NULL},
    {"num_dropped", T_LONGLONG, offsetof(Core, num_dropped), 0, NULL},
    {"poll_batch", T_LONGLONG, offsetof(Core, poll_batch), 0, NULL},
    {"max_deferred", T_LONGLONG, offsetof(Core, max_deferred), 0, NULL},
    {"lent", T_OBJECT, offsetof(Core, lent), 0, NULL},
    {"returned_append", T_OBJECT, offsetof(Core, returned_append), 0, NULL},
    {"spare_append", T_OBJECT, offsetof(Core, spare_append), 0, NULL},
    {"slow_poll_if_due", T_OBJECT, offsetof(Core, slow_poll_if_due), 0, NULL},
    {"slow_poll_while_waiting", T_OBJECT, offsetof(Core, slow_poll_while_waiting), 0, NULL},
    {"slow_event_after_stage", T_OBJECT, offsetof(Core, slow_event_after_stage), 0, NULL},
    {NULL},
};

static PyObject *
core_get_last(Core *self, void *closure)
{
    Py_INCREF(self->last);
    return self->last;
}

static int
core_set_last(Core *self, PyObject *value, void *closure)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "last cannot be deleted");
        return -1;
    }
    Py_INCREF(value);
    Py_SETREF(self->last, value);
    return 0;
}

static PyGetSetDef core_getset[] = {
    {"last", (getter)core_get_last, (setter)core_set_last, "the stage recorded last, or None",
     NULL},
    {NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "instrument._stagecore.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The hot state of one DeviceTimeline (instrument/device_timeline.py).",
    .tp_new = core_new,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_members = core_members,
    .tp_getset = core_getset,
};

/* An event from the pool, else a new one (a new reference; NULL on error). */
static PyObject *
core_take_event(Core *core)
{
    PyObject *free = core->free;
    if (free != NULL && PyList_CheckExact(free)) {
        Py_ssize_t n = PyList_GET_SIZE(free);
        if (n > 0) {
            PyObject *event = PyList_GET_ITEM(free, n - 1);
            Py_INCREF(event);
            if (PyList_SetSlice(free, n - 1, n, NULL) < 0) {
                Py_DECREF(event);
                return NULL;
            }
            return event;
        }
    }
    if (core->new_event == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the stage core has no event factory");
        return NULL;
    }
    return PyObject_CallNoArgs(core->new_event);
}

/* ------------------------------------------------------------------------------------------ */
/* Site                                                                                        */

typedef struct {
    PyObject_HEAD
    Core *core;
    PyObject *timeline, *name, *lane, *stream, *args, *queue, *stages, *append, *track;
    char stream_known;     /* stream_handle read (record_fn only) */
    void *stream_handle;
} Site;

static PyTypeObject SiteType;
static PyTypeObject ScopeType;
static PyTypeObject DerivedScopeType;

/* The object fields of Site: traversed and cleared from this one list. */
#define SITE_OBJECTS(X) \
    X(core) \
    X(timeline) \
    X(name) \
    X(lane) \
    X(stream) \
    X(args) \
    X(queue) \
    X(stages) \
    X(append) \
    X(track)

GC_FUNCTIONS(site, Site, SITE_OBJECTS)
PLAIN_DEALLOC(site, Site)

static int
site_init(Site *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"core", "timeline", "name", "lane", "stream", "args", "queue", NULL};
    PyObject *core, *timeline, *name, *lane, *stream, *sargs, *queue;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OOOOOO", kwlist, &CoreType, &core,
                                     &timeline, &name, &lane, &stream, &sargs, &queue))
        return -1;
    PyObject *stages = PyObject_GetAttrString(queue, "stages");
    if (stages == NULL)
        return -1;
    PyObject *append = PyObject_GetAttrString(stages, "append");
    if (append == NULL) {
        Py_DECREF(stages);
        return -1;
    }
    Py_INCREF(core);
    Py_XSETREF(self->core, (Core *)core);
    Py_INCREF(timeline);
    Py_XSETREF(self->timeline, timeline);
    Py_INCREF(name);
    Py_XSETREF(self->name, name);
    Py_INCREF(lane);
    Py_XSETREF(self->lane, lane);
    Py_INCREF(stream);
    Py_XSETREF(self->stream, stream);
    Py_INCREF(sargs);
    Py_XSETREF(self->args, sargs);
    Py_INCREF(queue);
    Py_XSETREF(self->queue, queue);
    Py_XSETREF(self->stages, stages);
    Py_XSETREF(self->append, append);
    Py_INCREF(Py_None);
    Py_XSETREF(self->track, Py_None);
    self->stream_known = 0;
    return 0;
}

/* Record ``event`` on the site's stream: cuEventRecord through record_fn on the raw handles
 * (an event torch has not created yet, handle 0, goes through core->record once), else
 * core->record(event, stream). 0, or -1 with an exception set. */
static int
site_record(Site *site, PyObject *event)
{
    Core *core = site->core;
    if (core->record_fn) {
        PyObject *h = PyObject_GetAttr(event, str_cuda_event);
        if (h == NULL)
            return -1;
        void *handle = (h == Py_None) ? NULL : PyLong_AsVoidPtr(h);
        Py_DECREF(h);
        if (handle == NULL && PyErr_Occurred())
            return -1;
        if (handle != NULL) {
            if (!site->stream_known) {
                PyObject *s = PyObject_GetAttr(site->stream, str_cuda_stream);
                if (s == NULL)
                    return -1;
                void *sh = (s == Py_None) ? NULL : PyLong_AsVoidPtr(s);
                Py_DECREF(s);
                if (sh == NULL && PyErr_Occurred())
                    return -1;
                site->stream_handle = sh;
                site->stream_known = 1;
            }
            int rc = ((record_fn_t)(uintptr_t)core->record_fn)(handle, site->stream_handle);
            if (rc != 0) {
                PyObject *cls = core->error_cls ? core->error_cls : PyExc_RuntimeError;
                PyErr_Format(cls, "cuEventRecord failed with CUresult %d", rc);
                return -1;
            }
            core->direct_records++;
            return 0;
        }
    }
    if (core->record == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the stage core has no record function");
        return -1;
    }
    PyObject *callargs[2] = {event, site->stream};
    PyObject *r = PyObject_Vectorcall(core->record, callargs, 2, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Scope                                                                                       */

typedef struct {
    PyObject_HEAD
    Site *site;
    PyObject *step, *args, *begin, *end, *host_end_ns, *end_ns, *end_given;
    PyObject *host_begin_ns, *after;
    char end_shared, lent;
    PyObject *weakreflist;
} Scope;

/* The object fields of Scope: traversed and cleared from this one list. */
#define SCOPE_OBJECTS(X) \
    X(site) \
    X(step) \
    X(args) \
    X(begin) \
    X(end) \
    X(host_end_ns) \
    X(end_ns) \
    X(end_given) \
    X(host_begin_ns) \
    X(after)

GC_FUNCTIONS(scope, Scope, SCOPE_OBJECTS)

static void
scope_dealloc(Scope *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    /* A chain of ``after`` stages is never long (the poll resolves and drops them). */
    scope_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
scope_enter(Scope *self, PyObject *unused)
{
    Py_INCREF(self);
    return (PyObject *)self;
}

/* The stage's enqueue is done: record its end event (unless a graph stamp is its end), take
 * the host time, queue it as its stream's newest pending stage, drop the oldest past the
 * limit. Returns False (exceptions propagate). An exception in the body: no slice. */
static PyObject *
scope_exit(Scope *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs >= 1 && args[0] != Py_None)
        Py_RETURN_FALSE;
    Site *site = self->site;
    if (site == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a stage scope without a site");
        return NULL;
    }
    Core *core = site->core;
    PyObject *end = self->end_given;
    if (end == NULL || end == Py_None) {
        end = core_take_event(core);
        if (end == NULL)
            return NULL;
        if (site_record(site, end) < 0) {
            /* Not recorded: the event is dropped, as the Python path drops it. */
            Py_DECREF(end);
            return NULL;
        }
    }
    else {
        Py_INCREF(end);
    }
    Py_XSETREF(self->end, end);
    PyObject *t = PyLong_FromLongLong(monotonic_ns());
    if (t == NULL)
        return NULL;
    Py_XSETREF(self->host_end_ns, t);
    Py_INCREF(self);
    Py_SETREF(core->last, (PyObject *)self);
    PyObject *r = PyObject_CallOneArg(site->append, (PyObject *)self);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    core->num_recorded += 1;
    if (core->num_recorded > core->drop_above) {
        r = PyObject_CallOneArg(core->drop_oldest, site->queue);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_FALSE;
}

static PyObject *
scope_get_emitted(Scope *self, void *closure)
{
    if (self->end_ns == NULL)
        Py_RETURN_FALSE;
    long long v = PyLong_AsLongLong(self->end_ns);
    if (v == -1 && PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(v >= 0);
}

static PyObject *
scope_get_name(Scope *self, void *closure)
{
    Py_INCREF(self->site->name);
    return self->site->name;
}

static PyObject *
scope_get_lane(Scope *self, void *closure)
{
    Py_INCREF(self->site->lane);
    return self->site->lane;
}

static PyObject *
scope_get_stream(Scope *self, void *closure)
{
    Py_INCREF(self->site->stream);
    return self->site->stream;
}

static PyGetSetDef scope_getset[] = {
    {"emitted", (getter)scope_get_emitted, NULL, "its slice was emitted", NULL},
    {"name", (getter)scope_get_name, NULL, NULL, NULL},
    {"lane", (getter)scope_get_lane, NULL, NULL, NULL},
    {"stream", (getter)scope_get_stream, NULL, NULL, NULL},
    {NULL},
};

/* T_OBJECT_EX: unset reads raise AttributeError (getattr(stage, "end_ns", None) as in Python). */
static PyMemberDef scope_members[] = {
    {"site", T_OBJECT, offsetof(Scope, site), READONLY, NULL},
    {"step", T_OBJECT, offsetof(Scope, step), 0, NULL},
    {"args", T_OBJECT, offsetof(Scope, args), 0, NULL},
    {"begin", T_OBJECT, offsetof(Scope, begin), 0, NULL},
    {"end", T_OBJECT, offsetof(Scope, end), 0, NULL},
    {"host_end_ns", T_OBJECT_EX, offsetof(Scope, host_end_ns), 0, NULL},
    {"end_ns", T_OBJECT_EX, offsetof(Scope, end_ns), 0, NULL},
    {"end_given", T_OBJECT, offsetof(Scope, end_given), 0, NULL},
    {"end_shared", T_BOOL, offsetof(Scope, end_shared), 0, NULL},
    {"lent", T_BOOL, offsetof(Scope, lent), 0, NULL},
    {NULL},
};

static PyMemberDef derived_members[] = {
    {"host_begin_ns", T_OBJECT_EX, offsetof(Scope, host_begin_ns), 0, NULL},
    {"after", T_OBJECT, offsetof(Scope, after), 0, NULL},
    {NULL},
};

static PyMethodDef scope_methods[] = {
    {"__enter__", (PyCFunction)scope_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))scope_exit, METH_FASTCALL, NULL},
    {NULL},
};

static PyTypeObject ScopeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "instrument._stagecore.Scope",
    .tp_basicsize = sizeof(Scope),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_doc = "One stage (instrument.device_timeline._StageScope, compiled).",
    .tp_dealloc = (destructor)scope_dealloc,
    .tp_traverse = (traverseproc)scope_traverse,
    .tp_clear = (inquiry)scope_clear,
    .tp_weaklistoffset = offsetof(Scope, weakreflist),
    .tp_methods = scope_methods,
    .tp_members = scope_members,
    .tp_getset = scope_getset,
};

static PyTypeObject DerivedScopeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "instrument._stagecore.DerivedScope",
    .tp_basicsize = sizeof(Scope),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A stage with a derived begin (instrument.device_timeline._DerivedScope, compiled).",
    .tp_dealloc = (destructor)scope_dealloc,
    .tp_traverse = (traverseproc)scope_traverse,
    .tp_clear = (inquiry)scope_clear,
    .tp_weaklistoffset = offsetof(Scope, weakreflist),
    .tp_members = derived_members,
};

static Scope *
scope_alloc(PyTypeObject *type, Site *site, PyObject *step, PyObject *args)
{
    Scope *scope = PyObject_GC_New(Scope, type);
    if (scope == NULL)
        return NULL;
    Py_INCREF(site);
    scope->site = site;
    Py_INCREF(step);
    scope->step = step;
    Py_INCREF(args);
    scope->args = args;
    scope->begin = NULL;
    scope->end = NULL;
    scope->host_end_ns = NULL;
    scope->end_ns = NULL;
    scope->end_given = NULL;
    scope->host_begin_ns = NULL;
    scope->after = NULL;
    scope->end_shared = 0;
    scope->lent = 0;
    scope->weakreflist = NULL;
    PyObject_GC_Track(scope);
    return scope;
}

/* The shared no-op scope of an untraced stage (instrument.device_timeline._NULL_SCOPE). */
static PyObject *null_scope;

/* Site.stage(step, after=None, contiguous=False, args=None, end=None): StageSite.stage. */
static PyObject *
site_stage(Site *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *step = NULL, *after = Py_None, *contiguous_o = Py_False, *sargs = Py_None;
    PyObject *end = Py_None;
    if (nargs < 1 || nargs > 5) {
        if (!(nargs == 0 && kwnames != NULL)) {
            PyErr_SetString(PyExc_TypeError, "stage() takes step, after, contiguous, args, end");
            return NULL;
        }
    }
    PyObject **slots[5] = {&step, &after, &contiguous_o, &sargs, &end};
    for (Py_ssize_t i = 0; i < nargs; i++)
        *slots[i] = args[i];
    if (kwnames != NULL) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t k = 0; k < nk; k++) {
            PyObject *key = PyTuple_GET_ITEM(kwnames, k);
            PyObject *value = args[nargs + k];
            if (key == str_after || PyUnicode_Compare(key, str_after) == 0)
                after = value;
            else if (key == str_contiguous || PyUnicode_Compare(key, str_contiguous) == 0)
                contiguous_o = value;
            else if (key == str_args || PyUnicode_Compare(key, str_args) == 0)
                sargs = value;
            else if (key == str_end || PyUnicode_Compare(key, str_end) == 0)
                end = value;
            else if (PyUnicode_CompareWithASCIIString(key, "step") == 0)
                step = value;
            else {
                PyErr_Format(PyExc_TypeError, "stage() got an unexpected keyword argument %R", key);
                return NULL;
            }
        }
    }
    if (step == NULL) {
        PyErr_SetString(PyExc_TypeError, "stage() missing its step");
        return NULL;
    }
    Core *core = self->core;
    if (core->tracer == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the stage core has no tracer");
        return NULL;
    }
    PyObject *enabled_o = PyObject_GetAttr(core->tracer, str_enabled);
    if (enabled_o == NULL)
        return NULL;
    int enabled = PyObject_IsTrue(enabled_o);
    Py_DECREF(enabled_o);
    if (enabled < 0)
        return NULL;
    if (!enabled) {
        /* Untraced work is enqueued now: the next traced stage cannot begin at the last
         * traced stage's end (tracing switched off and on again mid-run: Tracer.muted). The
         * first such stage after traced ones makes the stages still pending due
         * (DeviceTimeline._untraced_gap, Python: once per gap). */
        if (core->last != Py_None) {
            PyObject *r = PyObject_CallMethodNoArgs(self->timeline, str_untraced_gap);
            if (r == NULL)
                return NULL;
            Py_DECREF(r);
        }
        Py_INCREF(Py_None);
        Py_SETREF(core->last, Py_None);
        Py_INCREF(null_scope);
        return null_scope;
    }
    int contiguous = PyObject_IsTrue(contiguous_o);
    if (contiguous < 0)
        return NULL;
    PyObject *last_o = core->last;
    Scope *last = (last_o != Py_None && PyObject_TypeCheck(last_o, &ScopeType))
                      ? (Scope *)last_o : NULL;
    if (contiguous && last != NULL && last->site->stream == self->stream && !last->lent) {
        /* The stream reaches this stage's begin when it reaches the last stage's end. */
        last->end_shared = 1;
        if (end != Py_None && last->end_given != NULL && last->end_given != Py_None) {
            /* A stamped replay after a stamped stage: the last stage's host end is now. */
            PyObject *t = PyLong_FromLongLong(monotonic_ns());
            if (t == NULL)
                return NULL;
            Py_XSETREF(last->host_end_ns, t);
        }
        Scope *scope = scope_alloc(&ScopeType, self, step, sargs);
        if (scope == NULL)
            return NULL;
        Py_XINCREF(last->end);
        scope->begin = last->end;
        if (end != Py_None) {
            Py_INCREF(end);
            scope->end_given = end;
        }
        return (PyObject *)scope;
    }
    Scope *scope;
    if (core->derive) {
        int derived = 0;
        if (last_o != Py_None) {
            PyObject *known = PyObject_GetAttr(self->queue, str_known);
            if (known == NULL)
                return NULL;
            derived = PyObject_IsTrue(known);
            Py_DECREF(known);
            if (derived < 0)
                return NULL;
        }
        if (!derived) {
            PyObject *callargs[2] = {self->queue, last_o};
            PyObject *r = PyObject_Vectorcall(core->bounded, callargs, 2, NULL);
            if (r == NULL)
                return NULL;
            derived = PyObject_IsTrue(r);
            Py_DECREF(r);
            if (derived < 0)
                return NULL;
        }
        if (derived) {
            long long host_begin = monotonic_ns(); /* before a begin record */
            scope = scope_alloc(&DerivedScopeType, self, step, sargs);
            if (scope == NULL)
                return NULL;
            scope->host_begin_ns = PyLong_FromLongLong(host_begin);
            if (scope->host_begin_ns == NULL) {
                Py_DECREF(scope);
                return NULL;
            }
            Py_INCREF(after);
            scope->after = after;
            if (end != Py_None) {
                Py_INCREF(end);
                scope->end_given = end;
            }
            if (!core->record_begins) {
                Py_INCREF(Py_None);
                scope->begin = Py_None; /* derived at emit */
                return (PyObject *)scope;
            }
        }
        else {
            scope = scope_alloc(&ScopeType, self, step, sargs);
            if (scope == NULL)
                return NULL;
            if (end != Py_None) {
                Py_INCREF(end);
                scope->end_given = end;
            }
        }
    }
    else {
        scope = scope_alloc(&ScopeType, self, step, sargs);
        if (scope == NULL)
            return NULL;
        if (end != Py_None) {
            Py_INCREF(end);
            scope->end_given = end;
        }
    }
    PyObject *begin = core_take_event(core);
    if (begin == NULL) {
        Py_DECREF(scope);
        return NULL;
    }
    scope->begin = begin;
    if (site_record(self, begin) < 0) {
        Py_DECREF(scope);
        return NULL;
    }
    return (PyObject *)scope;
}

static PyMethodDef site_methods[] = {
    {"stage", (PyCFunction)(void (*)(void))site_stage, METH_FASTCALL | METH_KEYWORDS,
     "stage(step, after=None, contiguous=False, args=None, end=None): StageSite.stage"},
    {NULL},
};

static PyMemberDef site_members[] = {
    {"core", T_OBJECT, offsetof(Site, core), READONLY, NULL},
    {"timeline", T_OBJECT, offsetof(Site, timeline), READONLY, NULL},
    {"name", T_OBJECT, offsetof(Site, name), READONLY, NULL},
    {"lane", T_OBJECT, offsetof(Site, lane), READONLY, NULL},
    {"stream", T_OBJECT, offsetof(Site, stream), READONLY, NULL},
    {"args", T_OBJECT, offsetof(Site, args), READONLY, NULL},
    {"queue", T_OBJECT, offsetof(Site, queue), READONLY, NULL},
    {"stages", T_OBJECT, offsetof(Site, stages), READONLY, NULL},
    {"track", T_OBJECT, offsetof(Site, track), 0, NULL},
    {NULL},
};

static PyTypeObject SiteType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "instrument._stagecore.Site",
    .tp_basicsize = sizeof(Site),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Site(core, timeline, name, lane, stream, args, queue): StageSite, compiled.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)site_init,
    .tp_dealloc = (destructor)site_dealloc,
    .tp_traverse = (traverseproc)site_traverse,
    .tp_clear = (inquiry)site_clear,
    .tp_methods = site_methods,
    .tp_members = site_members,
};

/* ------------------------------------------------------------------------------------------ */
/* The timeline's once-per-step hooks: their common case in C, the rest in Python.             */

static PyObject *
call_slow(PyObject *slow, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (slow == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the stage core's slow path is not set");
        return NULL;
    }
    return PyObject_Vectorcall(slow, args, nargs, kwnames);
}

/* DeviceTimeline.poll_if_due: 0 until max_deferred stages are pending. */
static PyObject *
core_poll_if_due(Core *self, PyObject *unused)
{
    if (self->num_recorded - self->num_emitted - self->num_dropped < self->max_deferred)
        return PyLong_FromLong(0);
    return call_slow(self->slow_poll_if_due, NULL, 0, NULL);
}

/* DeviceTimeline.poll_while_waiting(done): 0 until poll_batch stages are pending. */
static PyObject *
core_poll_while_waiting(Core *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (self->num_recorded - self->num_emitted - self->num_dropped < self->poll_batch)
        return PyLong_FromLong(0);
    return call_slow(self->slow_poll_while_waiting, args, nargs, kwnames);
}

/* DeviceTimeline.event_after_stage(stream, make, *, wait_only=False) when tracing, right after
 * a stage on ``stream`` that may lend its end: that end event (lent unless wait_only). */
static PyObject *
core_event_after_stage(Core *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *stream = nargs >= 1 ? args[0] : NULL;
    int wait_only = 0;
    if (nargs >= 3) {
        wait_only = PyObject_IsTrue(args[2]);
    }
    else if (kwnames != NULL) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t k = 0; k < nk; k++) {
            PyObject *key = PyTuple_GET_ITEM(kwnames, k);
            if (PyUnicode_CompareWithASCIIString(key, "wait_only") == 0)
                wait_only = PyObject_IsTrue(args[nargs + k]);
            else if (PyUnicode_CompareWithASCIIString(key, "stream") == 0)
                stream = args[nargs + k];
        }
    }
    if (wait_only < 0)
        return NULL;
    PyObject *last_o = self->last;
    if (stream != NULL && stream != Py_None && last_o != Py_None &&
        PyObject_TypeCheck(last_o, &ScopeType)) {
        Scope *last = (Scope *)last_o;
        if (last->site->stream == stream && !last->lent && last->end != NULL &&
            (last->end_given == NULL || last->end_given == Py_None) && self->tracer != NULL) {
            PyObject *enabled_o = PyObject_GetAttr(self->tracer, str_enabled);
            if (enabled_o == NULL)
                return NULL;
            int enabled = PyObject_IsTrue(enabled_o);
            Py_DECREF(enabled_o);
            if (enabled < 0)
                return NULL;
            if (enabled && self->lent != NULL) {
                if (!wait_only) {
                    PyObject *key = PyLong_FromVoidPtr(last->end);
                    if (key == NULL)
                        return NULL;
                    int rc = PyDict_SetItem(self->lent, key, last_o);
                    Py_DECREF(key);
                    if (rc < 0)
                        return NULL;
                    last->lent = 1;
                }
                Py_INCREF(last->end);
                return last->end;
            }
        }
    }
    return call_slow(self->slow_event_after_stage, args, nargs, kwnames);
}

/* DeviceTimeline.give_back(event): a lent end back to the timeline, or a spare sync event. */
static PyObject *
core_give_back(Core *self, PyObject *event)
{
    PyObject *key = PyLong_FromVoidPtr(event);
    if (key == NULL)
        return NULL;
    int lent = self->lent != NULL ? PyDict_Contains(self->lent, key) : 0;
    Py_DECREF(key);
    if (lent < 0)
        return NULL;
    PyObject *append = lent ? self->returned_append : self->spare_append;
    if (append == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the stage core's give_back is not set");
        return NULL;
    }
    PyObject *r = PyObject_CallOneArg(append, event);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyMethodDef core_methods[] = {
    {"poll_if_due", (PyCFunction)core_poll_if_due, METH_NOARGS, NULL},
    {"poll_while_waiting", (PyCFunction)(void (*)(void))core_poll_while_waiting,
     METH_FASTCALL | METH_KEYWORDS, NULL},
    {"event_after_stage", (PyCFunction)(void (*)(void))core_event_after_stage,
     METH_FASTCALL | METH_KEYWORDS, NULL},
    {"give_back", (PyCFunction)core_give_back, METH_O, NULL},
    {NULL},
};

/* ------------------------------------------------------------------------------------------ */
/* SpanEnd: Tracer.span_end, compiled (instrument/tracer.py).                                  */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *tracer;          /* its .enabled */
    PyObject *extend;          /* the tracer's flat buffer's extend */
    PyObject *tls;             /* the tracer module's threading.local: .key, the thread's key */
    PyObject *register_thread; /* callable() -> a new thread's key */
    PyObject *ev_span;         /* instrument.events.EV_SPAN */
} SpanEnd;

/* The object fields of SpanEnd: traversed and cleared from this one list. */
#define SPAN_END_OBJECTS(X) \
    X(tracer) \
    X(extend) \
    X(tls) \
    X(register_thread) \
    X(ev_span)

GC_FUNCTIONS(span_end, SpanEnd, SPAN_END_OBJECTS)
PLAIN_DEALLOC(span_end, SpanEnd)

/* span_end(name, start_ns, step, args=None): a slice ``name`` on this thread's track from
 * ``start_ns`` to now, buffered flat as (EV_SPAN, key, name, start_ns, now, step, args);
 * nothing while the tracer is off. */
static PyObject *
span_end_vectorcall(SpanEnd *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *vals[4] = {NULL, NULL, NULL, Py_None};
    static const char *names[4] = {"name", "start_ns", "step", "args"};
    if (nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "span_end() takes name, start_ns, step, args");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        vals[i] = args[i];
    if (kwnames != NULL) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t k = 0; k < nk; k++) {
            PyObject *key = PyTuple_GET_ITEM(kwnames, k);
            int found = 0;
            for (int j = 0; j < 4; j++) {
                if (PyUnicode_CompareWithASCIIString(key, names[j]) == 0) {
                    vals[j] = args[nargs + k];
                    found = 1;
                    break;
                }
            }
            if (!found) {
                PyErr_Format(PyExc_TypeError, "span_end() got an unexpected keyword argument %R",
                             key);
                return NULL;
            }
        }
    }
    if (vals[0] == NULL || vals[1] == NULL || vals[2] == NULL) {
        PyErr_SetString(PyExc_TypeError, "span_end() missing name, start_ns or step");
        return NULL;
    }
    PyObject *enabled_o = PyObject_GetAttr(self->tracer, str_enabled);
    if (enabled_o == NULL)
        return NULL;
    int enabled = PyObject_IsTrue(enabled_o);
    Py_DECREF(enabled_o);
    if (enabled < 0)
        return NULL;
    if (!enabled)
        Py_RETURN_NONE;
    PyObject *key = PyObject_GetAttr(self->tls, str_key);
    if (key == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        PyErr_Clear(); /* the thread's first event */
        key = PyObject_CallNoArgs(self->register_thread);
        if (key == NULL)
            return NULL;
    }
    PyObject *now = PyLong_FromLongLong(monotonic_ns());
    if (now == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    PyObject *event = PyTuple_Pack(7, self->ev_span, key, vals[0], vals[1], now, vals[2],
                                   vals[3]);
    Py_DECREF(key);
    Py_DECREF(now);
    if (event == NULL)
        return NULL;
    PyObject *r = PyObject_CallOneArg(self->extend, event);
    Py_DECREF(event);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyObject *
span_end_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"tracer", "extend", "tls", "register_thread", "ev_span", NULL};
    PyObject *tracer, *extend, *tls, *register_thread, *ev_span;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO", kwlist, &tracer, &extend, &tls,
                                     &register_thread, &ev_span))
        return NULL;
    SpanEnd *self = (SpanEnd *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = (vectorcallfunc)span_end_vectorcall;
    Py_INCREF(tracer);
    self->tracer = tracer;
    Py_INCREF(extend);
    self->extend = extend;
    Py_INCREF(tls);
    self->tls = tls;
    Py_INCREF(register_thread);
    self->register_thread = register_thread;
    Py_INCREF(ev_span);
    self->ev_span = ev_span;
    return (PyObject *)self;
}

static PyTypeObject SpanEndType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "instrument._stagecore.SpanEnd",
    .tp_basicsize = sizeof(SpanEnd),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "SpanEnd(tracer, extend, tls, register_thread, ev_span): Tracer.span_end, compiled.",
    .tp_new = span_end_new,
    .tp_dealloc = (destructor)span_end_dealloc,
    .tp_traverse = (traverseproc)span_end_traverse,
    .tp_clear = (inquiry)span_end_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(SpanEnd, vectorcall),
};

/* ------------------------------------------------------------------------------------------ */

static PyObject *
set_null_scope(PyObject *module, PyObject *scope)
{
    Py_INCREF(scope);
    Py_XSETREF(null_scope, scope);
    Py_RETURN_NONE;
}

static PyObject *
stagecore_monotonic_ns(PyObject *module, PyObject *unused)
{
    return PyLong_FromLongLong(monotonic_ns());
}

/* A cuEventRecord that records nothing (benches: what the stage path itself costs). */
static int
null_record(void *event, void *stream)
{
    (void)event;
    (void)stream;
    return 0;
}

/* The raw handle of an event (its cuda_event; None or 0: none). 0 with an exception on error. */
static int
event_handle(PyObject *event, void **out)
{
    PyObject *h = PyObject_GetAttr(event, str_cuda_event);
    if (h == NULL)
        return -1;
    *out = (h == Py_None) ? NULL : PyLong_AsVoidPtr(h);
    Py_DECREF(h);
    if (*out == NULL && PyErr_Occurred())
        return -1;
    return 0;
}

/* elapsed_ms_many(fn, start, events, release_gil, error_cls): cuEventElapsedTime(&ms, start, e)
 * for each event, in order, as a list of floats; the handles are read first, then every call
 * is made in one stretch, without the GIL when release_gil (one handoff per batch, where the
 * ctypes calls hand it over once per event). A nonzero CUresult raises error_cls. */
static PyObject *
elapsed_ms_many(PyObject *module, PyObject *args)
{
    unsigned long long fn;
    PyObject *start, *events, *error_cls;
    int release;
    if (!PyArg_ParseTuple(args, "KOO!pO", &fn, &start, &PyList_Type, &events, &release,
                          &error_cls))
        return NULL;
    if (fn == 0) {
        PyErr_SetString(PyExc_ValueError, "no cuEventElapsedTime address");
        return NULL;
    }
    void *start_handle;
    if (event_handle(start, &start_handle) < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(events);
    void **handles = PyMem_Malloc((n > 0 ? n : 1) * sizeof(void *));
    float *ms = PyMem_Malloc((n > 0 ? n : 1) * sizeof(float));
    if (handles == NULL || ms == NULL) {
        PyMem_Free(handles);
        PyMem_Free(ms);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (event_handle(PyList_GET_ITEM(events, i), &handles[i]) < 0) {
            PyMem_Free(handles);
            PyMem_Free(ms);
            return NULL;
        }
    }
    elapsed_fn_t call = (elapsed_fn_t)(uintptr_t)fn;
    int rc = 0;
    Py_ssize_t done = 0;
    if (release) {
        Py_BEGIN_ALLOW_THREADS
        for (; done < n; done++) {
            rc = call(&ms[done], start_handle, handles[done]);
            if (rc != 0)
                break;
        }
        Py_END_ALLOW_THREADS
    }
    else {
        for (; done < n; done++) {
            rc = call(&ms[done], start_handle, handles[done]);
            if (rc != 0)
                break;
        }
    }
    PyMem_Free(handles);
    if (rc != 0) {
        PyMem_Free(ms);
        PyErr_Format(error_cls, "cuEventElapsedTime failed with CUresult %d", rc);
        return NULL;
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        PyMem_Free(ms);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyFloat_FromDouble((double)ms[i]);
        if (v == NULL) {
            Py_DECREF(out);
            PyMem_Free(ms);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    PyMem_Free(ms);
    return out;
}

/* ------------------------------------------------------------------------------------------ */
/* A poll's slices (DeviceTimeline._emit's build loop, compiled).                              */

/* dict.pop(id(obj)) into *out: 1 found, 0 not, -1 error. */
static int
pop_id(PyObject *dict, PyObject *obj, long long *out)
{
    PyObject *key = PyLong_FromVoidPtr(obj);
    if (key == NULL)
        return -1;
    PyObject *v = PyDict_GetItemWithError(dict, key);
    if (v == NULL) {
        Py_DECREF(key);
        return PyErr_Occurred() ? -1 : 0;
    }
    long long value = PyLong_AsLongLong(v);
    if (value == -1 && PyErr_Occurred()) {
        Py_DECREF(key);
        return -1;
    }
    int rc = PyDict_DelItem(dict, key);
    Py_DECREF(key);
    if (rc < 0)
        return -1;
    *out = value;
    return 1;
}

static int
set_id(PyObject *dict, PyObject *obj, long long value)
{
    PyObject *key = PyLong_FromVoidPtr(obj);
    PyObject *v = PyLong_FromLongLong(value);
    int rc = (key == NULL || v == NULL) ? -1 : PyDict_SetItem(dict, key, v);
    Py_XDECREF(key);
    Py_XDECREF(v);
    return rc;
}

static int
as_ll(PyObject *obj, long long *out)
{
    if (obj == NULL || obj == Py_None) {
        PyErr_SetString(PyExc_RuntimeError, "a stage time is missing");
        return -1;
    }
    *out = PyLong_AsLongLong(obj);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* collect_events(stages): the distinct events a poll converts, in order (a contiguous begin is
 * its predecessor's end: read once; a derived begin has none); None when a stage is not a
 * compiled one (the caller's Python loop handles it). */
static PyObject *
collect_events(PyObject *module, PyObject *stages)
{
    if (!PyList_Check(stages)) {
        PyErr_SetString(PyExc_TypeError, "collect_events() takes a list of stages");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(stages);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (!PyObject_TypeCheck(PyList_GET_ITEM(stages, k), &ScopeType))
            Py_RETURN_NONE;
    }
    PyObject *events = PyList_New(0);
    if (events == NULL)
        return NULL;
    PyObject *prev_end = NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        Scope *st = (Scope *)PyList_GET_ITEM(stages, k);
        PyObject *begin = st->begin, *end = st->end ? st->end : Py_None;
        if (begin != NULL && begin != Py_None && begin != prev_end &&
            PyList_Append(events, begin) < 0)
            goto fail;
        if (PyList_Append(events, end) < 0)
            goto fail;
        prev_end = end;
    }
    return events;
fail:
    Py_DECREF(events);
    return NULL;
}

/* emit_stages(stages, times, free, last, shared_ns, derive, ev_stage, stamp_type, track_of,
 * pending_end_ns) -> (slices, held): DeviceTimeline._emit's loop for compiled stages with
 * recorded or derived begins (not both), the same slices and the same bookkeeping (events back
 * to the pool, shared ends, derived begins); ``held`` is the newest stage when its end waits
 * for the next stage, else None. None (nothing changed) when a stage is not a compiled one. */
static PyObject *
emit_stages(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "emit_stages() takes 10 arguments");
        return NULL;
    }
    PyObject *stages = args[0], *times = args[1], *free = args[2], *last = args[3];
    PyObject *shared = args[4], *ev_stage = args[6], *stamp_type = args[7];
    PyObject *track_of = args[8], *pending_end_ns = args[9];
    int derive = PyObject_IsTrue(args[5]);
    if (derive < 0)
        return NULL;
    if (!PyList_Check(stages) || !PyList_Check(times) || !PyList_Check(free) ||
        !PyDict_Check(shared)) {
        PyErr_SetString(PyExc_TypeError, "emit_stages(): stages, times and free are lists, "
                                         "shared_ns a dict");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(stages), ntimes = PyList_GET_SIZE(times);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (!PyObject_TypeCheck(PyList_GET_ITEM(stages, k), &ScopeType))
            Py_RETURN_NONE;
    }
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    PyObject *held = Py_None;
    PyObject *prev_end = NULL;
    long long end_ns = 0;
    Py_ssize_t i = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        Scope *st = (Scope *)PyList_GET_ITEM(stages, k);
        PyObject *begin = st->begin ? st->begin : Py_None, *end = st->end ? st->end : Py_None;
        long long start_ns, t;
        if (begin == Py_None) {
            start_ns = -1; /* derived below, once its end is known */
        }
        else if (begin == prev_end) {
            start_ns = end_ns;
            if (pop_id(shared, begin, &t) < 0) /* stored just now, with its predecessor */
                goto fail;
        }
        else {
            if (i >= ntimes || as_ll(PyList_GET_ITEM(times, i), &start_ns) < 0)
                goto short_times;
            i++;
            if (PyDict_GET_SIZE(shared) > 0) { /* begins at an end an earlier poll emitted */
                int found = pop_id(shared, begin, &t);
                if (found < 0)
                    goto fail;
                if (found)
                    start_ns = t;
            }
        }
        if (i >= ntimes || as_ll(PyList_GET_ITEM(times, i), &end_ns) < 0)
            goto short_times;
        if (end_ns < start_ns)
            end_ns = start_ns;
        i++;
        prev_end = end;
        /* Read: free to record again; a shared end goes with the stage that shares it, a lent
         * one stays with the caller, and the newest stage's end waits for the next stage. */
        if (begin != Py_None && (PyObject *)Py_TYPE(begin) != stamp_type &&
            PyList_Append(free, begin) < 0)
            goto fail;
        if (st->end_shared) {
            if (set_id(shared, end, end_ns) < 0)
                goto fail;
        }
        else if ((PyObject *)st == last) {
            if (set_id(shared, end, end_ns) < 0)
                goto fail;
            if (!st->lent)
                held = (PyObject *)st;
        }
        else if (!st->lent && (PyObject *)Py_TYPE(end) != stamp_type) {
            if (PyList_Append(free, end) < 0)
                goto fail;
        }
        Site *site = st->site;
        if (site->track == NULL || site->track == Py_None) { /* the site's first slice */
            PyObject *callargs[2] = {site->lane, site->stream};
            PyObject *track = PyObject_Vectorcall(track_of, callargs, 2, NULL);
            if (track == NULL)
                goto fail;
            Py_XSETREF(site->track, track);
        }
        PyObject *end_obj = PyLong_FromLongLong(end_ns);
        if (end_obj == NULL)
            goto fail;
        Py_XSETREF(st->end_ns, end_obj); /* a later stage that waited for it reads it here */
        if (derive) {
            PyObject *queue = site->queue;
            if (Py_TYPE(st) == &DerivedScopeType) {
                long long derived, q_end, dep_end;
                if (as_ll(st->host_begin_ns, &derived) < 0)
                    goto fail;
                PyObject *q = PyObject_GetAttr(queue, str_end_ns);
                if (q == NULL)
                    goto fail;
                int bad = as_ll(q, &q_end);
                Py_DECREF(q);
                if (bad < 0)
                    goto fail;
                if (q_end > derived)
                    derived = q_end;
                PyObject *dep = st->after;
                if (dep != NULL && dep != Py_None) {
                    st->after = NULL; /* resolved: keep no earlier stage (reads None) */
                    PyObject *dep_end_obj;
                    if (PyObject_TypeCheck(dep, &ScopeType) && ((Scope *)dep)->end_ns != NULL) {
                        dep_end_obj = ((Scope *)dep)->end_ns;
                        Py_INCREF(dep_end_obj);
                    }
                    else { /* not emitted yet: read from its own end event */
                        dep_end_obj = PyObject_CallOneArg(pending_end_ns, dep);
                    }
                    Py_DECREF(dep); /* the reference st->after held */
                    if (dep_end_obj == NULL)
                        goto fail;
                    bad = as_ll(dep_end_obj, &dep_end);
                    Py_DECREF(dep_end_obj);
                    if (bad < 0)
                        goto fail;
                    if (dep_end > derived)
                        derived = dep_end;
                }
                if (derived > end_ns)
                    derived = end_ns;
                start_ns = derived;
            }
            PyObject *e = PyLong_FromLongLong(end_ns);
            if (e == NULL)
                goto fail;
            int rc = PyObject_SetAttr(queue, str_end_ns, e);
            Py_DECREF(e);
            if (rc < 0)
                goto fail;
        }
        PyObject *start_obj = PyLong_FromLongLong(start_ns);
        if (start_obj == NULL)
            goto fail;
        PyObject *event = PyTuple_New(9);
        if (event == NULL) {
            Py_DECREF(start_obj);
            goto fail;
        }
        PyObject *items[9] = {ev_stage, site->track, site->name, NULL, st->end_ns, site->args,
                              st->args ? st->args : Py_None, st->step ? st->step : Py_None,
                              st->host_end_ns ? st->host_end_ns : Py_None};
        for (int j = 0; j < 9; j++) {
            if (j == 3) {
                PyTuple_SET_ITEM(event, 3, start_obj); /* steals it */
                continue;
            }
            Py_INCREF(items[j]);
            PyTuple_SET_ITEM(event, j, items[j]);
        }
        PyList_SET_ITEM(out, k, event);
    }
    return Py_BuildValue("(NO)", out, held);
short_times:
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "emit_stages(): fewer times than events");
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"collect_events", collect_events, METH_O,
     "collect_events(stages): the distinct events a poll converts (None: not all compiled)"},
    {"emit_stages", (PyCFunction)(void (*)(void))emit_stages, METH_FASTCALL,
     "emit_stages(stages, times, free, last, shared_ns, derive, ev_stage, stamp_type, "
     "track_of, pending_end_ns) -> (slices, held), or None"},
    {"elapsed_ms_many", elapsed_ms_many, METH_VARARGS,
     "elapsed_ms_many(fn, start, events, release_gil, error_cls): cuEventElapsedTime per event"},
    {"set_null_scope", set_null_scope, METH_O, "the scope an untraced stage returns"},
    {"monotonic_ns", stagecore_monotonic_ns, METH_NOARGS, "the clock the stages stamp"},
    {NULL},
};

static struct PyModuleDef stagecore_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "instrument._stagecore",
    .m_doc = "The device timeline's stage hot path, compiled (instrument/native.py builds it).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__stagecore(void)
{
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;
    INTERN(str_enabled, "enabled");
    INTERN(str_untraced_gap, "_untraced_gap");
    INTERN(str_known, "known");
    INTERN(str_cuda_event, "cuda_event");
    INTERN(str_cuda_stream, "cuda_stream");
    INTERN(str_after, "after");
    INTERN(str_contiguous, "contiguous");
    INTERN(str_args, "args");
    INTERN(str_end, "end");
    INTERN(str_key, "key");
    INTERN(str_end_ns, "end_ns");
#undef INTERN
    Py_INCREF(Py_None);
    null_scope = Py_None;
    DerivedScopeType.tp_base = &ScopeType;
    CoreType.tp_methods = core_methods;
    if (PyType_Ready(&CoreType) < 0 || PyType_Ready(&SiteType) < 0 ||
        PyType_Ready(&ScopeType) < 0 || PyType_Ready(&DerivedScopeType) < 0 ||
        PyType_Ready(&SpanEndType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&stagecore_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Core", (PyObject *)&CoreType) < 0 ||
        PyModule_AddObjectRef(m, "Site", (PyObject *)&SiteType) < 0 ||
        PyModule_AddObjectRef(m, "Scope", (PyObject *)&ScopeType) < 0 ||
        PyModule_AddObjectRef(m, "DerivedScope", (PyObject *)&DerivedScopeType) < 0 ||
        PyModule_AddObjectRef(m, "SpanEnd", (PyObject *)&SpanEndType) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE_HASH", STAGECORE_SOURCE_HASH) < 0 ||
        PyModule_AddObject(m, "NULL_RECORD_ADDR",
                           PyLong_FromUnsignedLongLong((uintptr_t)&null_record)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/* Native relay engine of the delay proxy (`python -m kvmesh.bench.delay_proxy --engine native`).
 *
 * Same link as the threaded Python engine in delay_proxy.py (that file's docstring and `_Pipe` define the
 * semantics; this is a second implementation of them), on one thread: epoll, non-blocking sockets, and a
 * timerfd for the due and pacing times. The threaded engine pays a thread wake-up and a GIL hand-off per
 * chunk and per sleep (~0.7 ms p50 on a 2-core host with no delay configured); here a chunk costs a recv, a
 * copy and a sendmsg, and a wake-up happens only when a chunk falls due.
 *
 * Per direction of a connection (client -> upstream, upstream -> client): each chunk read is stamped
 * `due = now + delay` (CLOCK_MONOTONIC ns) and queued; it is written on once due. With a cap (`rate` > 0)
 * writes go in pieces of at most PIECE bytes on a virtual timeline `free_at` (each piece moves it by
 * len / rate), allowed to run PACE_SLACK_NS ahead of the clock; the queue holds at most `hold_bytes` (the
 * Python receiver may overshoot it by one read), and the source is not read while it is full (its sender
 * meets backpressure). A source that ends (EOF or a read error) has its queue delivered (or dropped, with
 * drop_on_close), then the whole connection ends: both sockets shut down and closed, as the Python sender
 * does, so what was queued the other way is lost (no half-close). A failed write ends it at once.
 *
 * Runs without the GIL until the process ends: serve() returns only to raise (a setup error, or what a
 * signal handler raises, such as KeyboardInterrupt).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define CHUNK (1 << 20)                         /* bytes read per recv at most (the Python engine's CHUNK) */
#define PIECE (16 << 10)                        /* bytes per paced write (PIECE) */
#define PACE_SLACK_NS 200000                    /* how far a capped writer may run ahead (PACE_SLACK_S) */
#define CONNECT_TIMEOUT_NS 10000000000LL        /* the Python engine's connect timeout: 10 s */
#define ACCEPT_PAUSE_NS 10000000LL              /* out of fds: retry accepting after 10 ms, not in a spin */
#define ACCEPTS_PER_WAKE 64                     /* then other events get a turn (the listener stays ready) */
#define DISCARD_READS 16                        /* reads of CHUNK to empty a socket before close (see teardown) */
#define MAX_IOV 64                              /* due chunks gathered into one sendmsg */
#define MAX_EVENTS 256                          /* events per epoll_wait (a batch size, not a limit) */
#define NO_SLOT SIZE_MAX

enum { CLIENT = 0, UPSTREAM = 1 };

/* A received chunk waiting in a direction's queue. */
typedef struct chunk {
    struct chunk *next;
    int64_t due;     /* CLOCK_MONOTONIC ns from which its bytes may be written on */
    size_t off, len; /* data[off:len] is still to write */
    char data[];
} chunk;

typedef struct conn conn;

/* One direction of a connection: bytes read from end[src], queued until due, written to end[dst]. */
typedef struct direction {
    conn *owner;
    int src, dst;       /* CLIENT or UPSTREAM */
    chunk *head, *tail; /* FIFO; due times never decrease along it */
    size_t queued;      /* bytes in the queue */
    int64_t free_at;    /* capped: when the link can take the next byte */
    int64_t wake_at;    /* when the timer services it (valid while slot != NO_SLOT) */
    size_t slot;        /* index in the timer heap, NO_SLOT when not scheduled */
    bool eof;           /* the source ended */
    bool blocked;       /* the destination's send buffer was full: waiting for EPOLLOUT */
    bool to_client;     /* its bytes count as forwarded progress */
} direction;

/* One socket of a connection; epoll events point here. */
typedef struct endpoint {
    conn *owner;
    int fd;
    uint32_t events; /* interest registered with epoll; 0 = not registered (see sync_interest) */
} endpoint;

struct conn {
    endpoint end[2];
    direction dir[2]; /* dir[s] reads end[s]: dir[CLIENT] is client -> upstream */
    bool connecting;  /* the upstream connect is under way (its deadline uses dir[CLIENT]'s timer slot) */
    bool dead;        /* torn down; freed after the current batch of events (they may still point here) */
    conn *prev, *next;
};

typedef struct relay {
    int epfd, timerfd, listen_fd, listen_flags;
    struct sockaddr_storage target;
    socklen_t target_len;
    int64_t delay;
    double rate;
    size_t hold;
    bool drop_on_close;
    uint64_t report_every, forwarded;
    direction **heap; /* min-heap on wake_at: the directions waiting for a due or pacing time */
    size_t heap_len, heap_cap;
    size_t nconns;
    int64_t timer_at;        /* absolute time the timerfd is armed for, 0 = disarmed */
    int64_t accept_resume_at; /* 0 = the listener is registered */
    conn *live, *graveyard;
    char *scratch; /* CHUNK bytes: recv lands here, then the exact length is copied into a chunk */
} relay;

static char listener_tag, timer_tag; /* epoll data for the two fds that are not connection endpoints */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ---- timer heap ------------------------------------------------------------------------------------- */

static bool heap_reserve(relay *r, size_t n) {
    if (n <= r->heap_cap) return true;
    size_t cap = r->heap_cap ? r->heap_cap : 64;
    while (cap < n) cap *= 2;
    direction **h = realloc(r->heap, cap * sizeof *h);
    if (h == NULL) return false;
    r->heap = h;
    r->heap_cap = cap;
    return true;
}

static void heap_place(relay *r, size_t i, direction *d) {
    r->heap[i] = d;
    d->slot = i;
}

static void heap_up(relay *r, size_t i) {
    direction *d = r->heap[i];
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (r->heap[parent]->wake_at <= d->wake_at) break;
        heap_place(r, i, r->heap[parent]);
        i = parent;
    }
    heap_place(r, i, d);
}

static void heap_down(relay *r, size_t i) {
    direction *d = r->heap[i];
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= r->heap_len) break;
        if (child + 1 < r->heap_len && r->heap[child + 1]->wake_at < r->heap[child]->wake_at) child++;
        if (r->heap[child]->wake_at >= d->wake_at) break;
        heap_place(r, i, r->heap[child]);
        i = child;
    }
    heap_place(r, i, d);
}

/* Services `d` at `at`. Cannot fail: open_conn reserved a slot for each direction of each connection. */
static void schedule(relay *r, direction *d, int64_t at) {
    if (d->slot != NO_SLOT) {
        int64_t was = d->wake_at;
        d->wake_at = at;
        if (at < was) heap_up(r, d->slot);
        else if (at > was) heap_down(r, d->slot);
        return;
    }
    d->wake_at = at;
    heap_place(r, r->heap_len++, d);
    heap_up(r, d->slot);
}

static void unschedule(relay *r, direction *d) {
    size_t i = d->slot;
    if (i == NO_SLOT) return;
    d->slot = NO_SLOT;
    direction *last = r->heap[--r->heap_len];
    if (i == r->heap_len) return;
    heap_place(r, i, last);
    heap_up(r, i);
    heap_down(r, last->slot);
}

/* ---- connections ------------------------------------------------------------------------------------- */

static void drop_queue(direction *d) {
    while (d->head != NULL) {
        chunk *next = d->head->next;
        free(d->head);
        d->head = next;
    }
    d->tail = NULL;
    d->queued = 0;
}

/* Ends a connection: both sockets shut down (a FIN after what the kernel still holds to send, as the Python
 * sender's shutdown(SHUT_RDWR)), what they hold unread thrown away (a close with unread bytes would send a
 * reset instead, and a reset discards the bytes still unsent), closed (which also removes them from epoll);
 * queues freed. The struct itself waits in the graveyard until the batch of events is done. */
static void teardown(relay *r, conn *c) {
    if (c->dead) return;
    c->dead = true;
    for (int s = 0; s < 2; s++) {
        endpoint *e = &c->end[s];
        if (e->fd < 0) continue;
        shutdown(e->fd, SHUT_RDWR);
        for (int i = 0; i < DISCARD_READS && recv(e->fd, r->scratch, CHUNK, MSG_DONTWAIT) > 0; i++) {
        }
        close(e->fd);
        e->fd = -1;
        e->events = 0;
    }
    for (int s = 0; s < 2; s++) {
        unschedule(r, &c->dir[s]);
        drop_queue(&c->dir[s]);
    }
    if (c->prev != NULL) c->prev->next = c->next;
    else r->live = c->next;
    if (c->next != NULL) c->next->prev = c->prev;
    c->prev = NULL;
    c->next = r->graveyard;
    r->graveyard = c;
    r->nconns--;
}

static void bury(relay *r) {
    while (r->graveyard != NULL) {
        conn *next = r->graveyard->next;
        free(r->graveyard);
        r->graveyard = next;
    }
}

static bool reading(const relay *r, const direction *d) {
    return !d->eof && (r->rate <= 0 || d->queued < r->hold);
}

/* Registers with epoll exactly the events each endpoint waits for. An endpoint that waits for none is
 * removed: epoll reports EPOLLERR/EPOLLHUP whatever the mask, so a reset socket that is not being read
 * (a full capped queue) would wake the loop in a spin; it is read again, and its error seen, once there
 * is room (as the Python receiver sees it on its next recv). */
static void sync_interest(relay *r, conn *c) {
    for (int s = 0; s < 2 && !c->dead; s++) {
        endpoint *e = &c->end[s];
        uint32_t want = 0;
        if (c->connecting) want = s == UPSTREAM ? EPOLLOUT : 0;
        else want = (reading(r, &c->dir[s]) ? EPOLLIN : 0) | (c->dir[!s].blocked ? EPOLLOUT : 0);
        if (want == e->events) continue;
        struct epoll_event ev = {.events = want, .data.ptr = e};
        int op = e->events == 0 ? EPOLL_CTL_ADD : want != 0 ? EPOLL_CTL_MOD : EPOLL_CTL_DEL;
        if (epoll_ctl(r->epfd, op, e->fd, &ev) < 0) {
            teardown(r, c);
            return;
        }
        e->events = want;
    }
}

static void write_all(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return; /* stdout gone: the reports are a courtesy, the link goes on */
        p += w;
        n -= (size_t)w;
    }
}

/* Counts bytes delivered to a client; prints `forwarded <total>` at each multiple of report_every crossed. */
static void report(relay *r, size_t n) {
    if (r->report_every == 0) return;
    uint64_t before = r->forwarded;
    r->forwarded += n;
    if (r->forwarded / r->report_every > before / r->report_every) {
        char line[40];
        int len = snprintf(line, sizeof line, "forwarded %llu\n", (unsigned long long)r->forwarded);
        if (len > 0) write_all(STDOUT_FILENO, line, (size_t)len);
    }
}

/* One sendmsg of the due bytes at the head of `d`, at most `budget`; sets *asked to the bytes offered. */
static ssize_t send_due(direction *d, int64_t now, size_t budget, size_t *asked) {
    struct iovec iov[MAX_IOV];
    int n = 0;
    size_t total = 0;
    for (chunk *k = d->head; k != NULL && n < MAX_IOV && total < budget && k->due <= now; k = k->next) {
        size_t len = k->len - k->off;
        if (len > budget - total) len = budget - total;
        iov[n].iov_base = k->data + k->off;
        iov[n].iov_len = len;
        total += len;
        n++;
    }
    *asked = total;
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)n};
    return sendmsg(d->owner->end[d->dst].fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
}

static void consume(direction *d, size_t n) {
    d->queued -= n;
    while (n > 0) {
        chunk *k = d->head;
        size_t left = k->len - k->off;
        if (n < left) {
            k->off += n;
            return;
        }
        n -= left;
        d->head = k->next;
        free(k);
    }
    if (d->head == NULL) d->tail = NULL;
}

/* Writes what is due (and, capped, what the pacing allows) until the destination is full; schedules the
 * direction for its next due or pacing time; ends the connection once a finished source is drained. */
static void flush(relay *r, direction *d) {
    conn *c = d->owner;
    if (d->blocked) return;
    int64_t now = now_ns();
    while (d->head != NULL) {
        if (d->head->due > now) {
            schedule(r, d, d->head->due);
            return;
        }
        size_t budget = SIZE_MAX;
        if (r->rate > 0) {
            /* wake at the first moment the slack allows a write, not at free_at: a late wake-up then
             * costs no rate, as free_at stays ahead of the clock and advances by exactly len / rate */
            if (d->free_at > now + PACE_SLACK_NS) {
                schedule(r, d, d->free_at - PACE_SLACK_NS);
                return;
            }
            budget = PIECE;
        }
        size_t asked;
        ssize_t n = send_due(d, now, budget, &asked);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) n = 0;
        else if (n < 0) {
            teardown(r, c);
            return;
        }
        consume(d, (size_t)n);
        if (r->rate > 0) {
            int64_t from = d->free_at > now ? d->free_at : now;
            d->free_at = from + (int64_t)((double)n * 1e9 / r->rate + 0.5);
        }
        if (d->to_client) report(r, (size_t)n);
        if ((size_t)n < asked) { /* the send buffer is full: go on when EPOLLOUT says there is room */
            d->blocked = true;
            unschedule(r, d);
            return;
        }
        now = now_ns();
    }
    unschedule(r, d);
    if (d->eof) teardown(r, c); /* drained: the Python sender shuts both sockets down here */
}

static void source_ended(relay *r, direction *d) {
    d->eof = true;
    if (r->drop_on_close) { /* the link's end went down: what it still carried is lost, at once */
        drop_queue(d);
        d->blocked = false;
    }
    flush(r, d);
}

/* One recv from the source of `d` (level-triggered epoll calls again while there is more: one read per
 * turn keeps a fast sender from starving the other connections and the timer). */
static void pump(relay *r, direction *d) {
    conn *c = d->owner;
    size_t room = CHUNK;
    if (r->rate > 0 && r->hold - d->queued < room) room = r->hold - d->queued;
    ssize_t n = recv(c->end[d->src].fd, r->scratch, room, 0);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n <= 0) { /* EOF, or a read error: the Python receiver takes both for the source's end */
        source_ended(r, d);
        return;
    }
    chunk *k = malloc(sizeof *k + (size_t)n);
    if (k == NULL) {
        teardown(r, c);
        return;
    }
    memcpy(k->data, r->scratch, (size_t)n);
    k->due = now_ns() + r->delay;
    k->off = 0;
    k->len = (size_t)n;
    k->next = NULL;
    if (d->tail != NULL) d->tail->next = k;
    else d->head = k;
    d->tail = k;
    d->queued += (size_t)n;
    flush(r, d);
}

static void set_nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static void init_direction(direction *d, conn *c, int src) {
    d->owner = c;
    d->src = src;
    d->dst = !src;
    d->slot = NO_SLOT;
    d->to_client = src == UPSTREAM;
}

/* A new client: connect to the target without blocking the loop; the client is read once connected. */
static void open_conn(relay *r, int client) {
    conn *c = calloc(1, sizeof *c);
    if (c == NULL || !heap_reserve(r, 2 * (r->nconns + 1))) {
        free(c);
        close(client);
        return;
    }
    c->end[CLIENT] = (endpoint){.owner = c, .fd = client};
    c->end[UPSTREAM] = (endpoint){.owner = c, .fd = -1};
    init_direction(&c->dir[CLIENT], c, CLIENT);
    init_direction(&c->dir[UPSTREAM], c, UPSTREAM);
    c->next = r->live;
    if (r->live != NULL) r->live->prev = c;
    r->live = c;
    r->nconns++;
    int up = socket(r->target.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, IPPROTO_TCP);
    if (up < 0) {
        teardown(r, c);
        return;
    }
    c->end[UPSTREAM].fd = up;
    /* Capped: a small receive buffer, set before the handshake (the window it advertises is what the target
     * may have in flight). On the upstream socket only, as the Python engine: accepted sockets keep theirs. */
    if (r->rate > 0) {
        int size = r->hold > INT_MAX ? INT_MAX : (int)r->hold;
        setsockopt(up, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
    }
    set_nodelay(client);
    set_nodelay(up);
    if (connect(up, (struct sockaddr *)&r->target, r->target_len) < 0) {
        if (errno != EINPROGRESS) {
            teardown(r, c);
            return;
        }
        c->connecting = true;
        schedule(r, &c->dir[CLIENT], now_ns() + CONNECT_TIMEOUT_NS);
    }
    sync_interest(r, c);
}

static void finish_connect(relay *r, conn *c) {
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(c->end[UPSTREAM].fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0) err = errno;
    if (err != 0) {
        teardown(r, c);
        return;
    }
    c->connecting = false;
    unschedule(r, &c->dir[CLIENT]);
}

static void on_endpoint(relay *r, endpoint *e, uint32_t events) {
    conn *c = e->owner;
    if (c->dead) return;
    if (c->connecting) {
        finish_connect(r, c);
    } else {
        int s = (int)(e - c->end);
        direction *in = &c->dir[!s], *out = &c->dir[s];
        if ((events & (EPOLLOUT | EPOLLERR | EPOLLHUP)) && in->blocked) {
            in->blocked = false;
            flush(r, in);
        }
        if (!c->dead && (events & (EPOLLIN | EPOLLERR | EPOLLHUP)) && reading(r, out)) pump(r, out);
    }
    sync_interest(r, c);
}

/* ---- listener and timer ------------------------------------------------------------------------------ */

static int listener_ctl(relay *r, int op) {
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &listener_tag};
    return epoll_ctl(r->epfd, op, r->listen_fd, &ev);
}

static void on_listener(relay *r) {
    for (int i = 0; i < ACCEPTS_PER_WAKE; i++) {
        int fd = accept4(r->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0) {
            open_conn(r, fd);
            continue;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            /* the pending connection stays pending and the level-triggered listener would spin: pause */
            if (listener_ctl(r, EPOLL_CTL_DEL) == 0) r->accept_resume_at = now_ns() + ACCEPT_PAUSE_NS;
            return;
        }
        /* anything else (ECONNABORTED, EPROTO, EPERM, ...) concerns that one connection: next */
    }
}

/* Services every direction whose time has come (and the paused listener). */
static void run_timers(relay *r) {
    int64_t now = now_ns();
    if (r->accept_resume_at != 0 && r->accept_resume_at <= now && listener_ctl(r, EPOLL_CTL_ADD) == 0)
        r->accept_resume_at = 0;
    while (r->heap_len > 0 && r->heap[0]->wake_at <= now) {
        direction *d = r->heap[0];
        conn *c = d->owner;
        unschedule(r, d);
        if (c->connecting) {
            teardown(r, c); /* the connect timed out */
            continue;
        }
        flush(r, d); /* reschedules it, at a time after `now`, if anything is left */
        if (!c->dead) sync_interest(r, c);
    }
}

/* Arms the timerfd for the earliest wake-up. A timerfd, not epoll_wait's timeout: that timeout counts whole
 * milliseconds, and a 0.5 ms delay needs nanoseconds, on the absolute CLOCK_MONOTONIC the due times use. */
static int arm_timer(relay *r) {
    int64_t at = r->heap_len > 0 ? r->heap[0]->wake_at : 0;
    if (r->accept_resume_at != 0 && (at == 0 || r->accept_resume_at < at)) at = r->accept_resume_at;
    if (at == r->timer_at) return 0;
    struct itimerspec its = {{0, 0}, {at / 1000000000LL, at % 1000000000LL}};
    if (timerfd_settime(r->timerfd, TFD_TIMER_ABSTIME, &its, NULL) < 0) return -1;
    r->timer_at = at;
    return 0;
}

static void on_timer(relay *r) {
    uint64_t ticks;
    if (read(r->timerfd, &ticks, sizeof ticks) == (ssize_t)sizeof ticks) r->timer_at = 0; /* it fired: re-arm */
}

/* The event loop; returns only an errno: EINTR for a signal (the caller checks Python's handlers), else a
 * failure of epoll or the timerfd themselves. */
static int run(relay *r) {
    struct epoll_event events[MAX_EVENTS];
    for (;;) {
        int n = epoll_wait(r->epfd, events, MAX_EVENTS, -1);
        if (n < 0) return errno;
        for (int i = 0; i < n; i++) {
            void *p = events[i].data.ptr;
            if (p == &listener_tag) on_listener(r);
            else if (p == &timer_tag) on_timer(r);
            else on_endpoint(r, p, events[i].events);
        }
        run_timers(r);
        bury(r);
        if (arm_timer(r) < 0) return errno;
    }
}

/* ---- Python entry point ------------------------------------------------------------------------------ */

static void relay_close(relay *r) {
    while (r->live != NULL) teardown(r, r->live);
    bury(r);
    free(r->heap);
    free(r->scratch);
    if (r->epfd >= 0) close(r->epfd);
    if (r->timerfd >= 0) close(r->timerfd);
    if (r->listen_flags >= 0) fcntl(r->listen_fd, F_SETFL, r->listen_flags);
}

static int resolve(relay *r, const char *host, int port) {
    char service[16];
    snprintf(service, sizeof service, "%d", port);
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICHOST | AI_NUMERICSERV};
    struct addrinfo *res;
    int rc = getaddrinfo(host, service, &hints, &res);
    if (rc != 0) {
        PyErr_Format(PyExc_OSError, "target %s:%d: %s (a numeric address is expected)", host, port,
                     gai_strerror(rc));
        return -1;
    }
    memcpy(&r->target, res->ai_addr, res->ai_addrlen);
    r->target_len = res->ai_addrlen;
    freeaddrinfo(res);
    return 0;
}

static int relay_open(relay *r) {
    r->scratch = malloc(CHUNK);
    if (r->scratch == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    r->listen_flags = fcntl(r->listen_fd, F_GETFL);
    if (r->listen_flags < 0 || fcntl(r->listen_fd, F_SETFL, r->listen_flags | O_NONBLOCK) < 0) goto fail;
    r->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (r->epfd < 0) goto fail;
    r->timerfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (r->timerfd < 0) goto fail;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &timer_tag};
    if (epoll_ctl(r->epfd, EPOLL_CTL_ADD, r->timerfd, &ev) < 0 || listener_ctl(r, EPOLL_CTL_ADD) < 0) goto fail;
    return 0;
fail:
    PyErr_SetFromErrno(PyExc_OSError);
    return -1;
}

static PyObject *py_serve(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"listen_fd", "target_host",   "target_port",  "delay_ns", "rate",
                               "hold_bytes", "drop_on_close", "report_every", NULL};
    int listen_fd, port, drop_on_close;
    const char *host;
    long long delay_ns, report_every;
    double rate;
    Py_ssize_t hold;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "isiLdnpL:serve", keywords, &listen_fd, &host, &port,
                                     &delay_ns, &rate, &hold, &drop_on_close, &report_every))
        return NULL;
    if (listen_fd < 0 || port < 0 || port > 65535 || delay_ns < 0 || !(rate >= 0) || !isfinite(rate) ||
        hold <= 0 || report_every < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "serve: needs listen_fd >= 0, 0 <= target_port <= 65535, delay_ns >= 0, a finite "
                        "rate >= 0, hold_bytes > 0, report_every >= 0");
        return NULL;
    }
    relay r = {.epfd = -1, .timerfd = -1, .listen_fd = listen_fd, .listen_flags = -1, .delay = delay_ns,
               .rate = rate, .hold = (size_t)hold, .drop_on_close = drop_on_close != 0,
               .report_every = (uint64_t)report_every};
    if (resolve(&r, host, port) < 0 || relay_open(&r) < 0) {
        relay_close(&r);
        return NULL;
    }
    /* Timers of this thread expire up to its timer slack late (50 us by default, the kernel coalescing
     * wake-ups); a link that adds 0.5 ms must not add 10% more at random. */
    int slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    for (;;) {
        int err;
        Py_BEGIN_ALLOW_THREADS
        err = run(&r);
        Py_END_ALLOW_THREADS
        if (err == EINTR && PyErr_CheckSignals() == 0) continue; /* a handler that did not raise */
        if (err != EINTR) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
        }
        break;
    }
    if (slack > 0) prctl(PR_SET_TIMERSLACK, (unsigned long)slack, 0, 0, 0);
    relay_close(&r);
    return NULL;
}

static PyMethodDef methods[] = {
    {"serve", (PyCFunction)(void (*)(void))py_serve, METH_VARARGS | METH_KEYWORDS,
     "serve(listen_fd, target_host, target_port, delay_ns, rate, hold_bytes, drop_on_close, report_every)\n"
     "Relays every connection accepted on the listening socket `listen_fd` to the numeric address "
     "target_host:target_port, delaying each direction by delay_ns and capping it at `rate` bytes/s "
     "(0 = none, holding at most hold_bytes queued); runs until the process ends, without the GIL. Raises "
     "OSError on a setup failure, or what a signal handler raises."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "kvmesh.bench._link", "Native relay engine of the delay proxy (epoll + timerfd).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__link(void) { return PyModule_Create(&moduledef); }

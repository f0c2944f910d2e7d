/* mpcache-bench rpc's throughput client: one DEALER, `window` requests in flight, a C loop.

   Built by mpcache/bench/bench_rpc.py (cc, linked against the libzmq that pyzmq ships), so the client
   processes cost little CPU next to the server they measure: the rate a row prints is the
   server's, not the clients' (the Python clients took most of a 2-core box).

   Every request is a real round trip through the server: frames pre-encoded by bench_rpc.py,
   a fresh uid per request, each reply matched by its op frame (and, where given, its result
   frame), so an error reply or a wrong hit count is counted as an error, never as done.

   usage: rpc_client URL SPEC_FILE WINDOW
     After connecting and its set-up calls it prints "ready" and reads "START_AT END_AT" from
     stdin: wall-clock seconds (time.time()); it sends from then on, and counts the replies that
     arrive between START_AT and END_AT (so a slow start on a loaded box never eats the window).
   SPEC_FILE: u32 count, then count blobs of (u32 length, bytes), little-endian:
     0 mode ("fixed" | "lookup")   1 op frame a counted reply carries
     2 result frame a counted reply must carry (empty: not checked)
     3 end_session op frame (lookup)   4 request id prefix (lookup)
     5 key frame head   6 key frame tail   7 tp_size frame   8 request op frame
     9 "A P Q" (ASCII counts), then A argument frames cycled by request (none: the request
       has no payload), P messages sent one by one before the run and Q after it (each blob a
       message: frames as (u32 length, bytes), no uid; its reply must echo its op frame)
   A lookup's request id is PREFIX + "%010d" % n, put between head and tail as a msgpack str;
   when its reply arrives, end_session(that id) is sent under uid END_UID_BASE + n (served,
   not counted), as vLLM's connector ends every lookup.
   prints: done errors ends_sent ends_answered */

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The few libzmq 4.x entry points used (stable ABI); declared here so no zmq.h is needed. */
typedef struct zmq_msg_t { unsigned char _[64] __attribute__((aligned(sizeof(void *)))); } zmq_msg_t;
typedef struct { void *socket; int fd; short events; short revents; } zmq_pollitem_t;
void *zmq_ctx_new(void);
int zmq_ctx_term(void *);
void *zmq_socket(void *, int);
int zmq_close(void *);
int zmq_setsockopt(void *, int, const void *, size_t);
int zmq_connect(void *, const char *);
int zmq_send(void *, const void *, size_t, int);
int zmq_msg_init(zmq_msg_t *);
int zmq_msg_recv(zmq_msg_t *, void *, int);
int zmq_msg_close(zmq_msg_t *);
void *zmq_msg_data(zmq_msg_t *);
size_t zmq_msg_size(const zmq_msg_t *);
int zmq_msg_more(const zmq_msg_t *);
int zmq_poll(zmq_pollitem_t *, int, long);
int zmq_errno(void);

#define ZMQ_DEALER 5
#define ZMQ_DONTWAIT 1
#define ZMQ_SNDMORE 2
#define ZMQ_POLLIN 1
#define ZMQ_LINGER 17
#define ZMQ_RECONNECT_IVL 18
#define ZMQ_SNDHWM 23
#define ZMQ_RCVHWM 24

#define END_UID_BASE (1ULL << 40)
#define MAX_BLOBS 1024

typedef struct { unsigned char *p; size_t n; } blob;

static blob blobs[MAX_BLOBS];
static unsigned nblobs;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const char *what) {
    fprintf(stderr, "rpc_client: %s (errno %d)\n", what, zmq_errno());
    exit(2);
}

static void load_spec(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) die("cannot open the spec file");
    uint32_t count, len;
    if (fread(&count, 4, 1, f) != 1 || count > MAX_BLOBS) die("bad spec file");
    for (unsigned i = 0; i < count; i++) {
        if (fread(&len, 4, 1, f) != 1) die("bad spec file");
        blobs[i].n = len;
        blobs[i].p = malloc(len ? len : 1);
        if (len && fread(blobs[i].p, 1, len, f) != len) die("bad spec file");
    }
    nblobs = count;
    fclose(f);
}

static int blob_is(const blob *b, const char *s) {
    return b->n == strlen(s) && memcmp(b->p, s, b->n) == 0;
}

/* msgpack uint64 (0xcf + 8 bytes big-endian): a valid uid frame for any n */
static void put_uid(unsigned char out[9], uint64_t n) {
    out[0] = 0xcf;
    for (int i = 0; i < 8; i++) out[1 + i] = (unsigned char)(n >> (56 - 8 * i));
}

static int get_uid(const unsigned char *p, size_t n, uint64_t *out) {
    if (n == 1 && p[0] < 0x80) { *out = p[0]; return 0; }
    size_t want = p[0] == 0xcc ? 2 : p[0] == 0xcd ? 3 : p[0] == 0xce ? 5 : p[0] == 0xcf ? 9 : 0;
    if (!want || n != want) return -1;
    uint64_t v = 0;
    for (size_t i = 1; i < n; i++) v = (v << 8) | p[i];
    *out = v;
    return 0;
}

/* msgpack str of PREFIX + %010llu into out; returns its length */
static size_t put_rid(unsigned char *out, const blob *prefix, uint64_t n) {
    char digits[32];
    int d = snprintf(digits, sizeof digits, "%010llu", (unsigned long long)n);
    size_t len = prefix->n + (size_t)d, at;
    if (len < 32) { out[0] = (unsigned char)(0xa0 | len); at = 1; }
    else { out[0] = 0xd9; out[1] = (unsigned char)len; at = 2; }
    memcpy(out + at, prefix->p, prefix->n);
    memcpy(out + at + prefix->n, digits, (size_t)d);
    return at + len;
}

static void send_frame(void *s, const void *p, size_t n, int more) {
    while (zmq_send(s, p, n, more ? ZMQ_SNDMORE : 0) < 0) {
        if (zmq_errno() != EINTR) die("send failed");
    }
}

/* One call, one in flight: the set-up and clean-up messages (on this socket: request ids
   belong to the connection that named them). Dies unless the reply echoes the op frame. */
static void call_message(void *s, const blob *msg, uint64_t uid) {
    unsigned char uidbuf[9];
    const unsigned char *op = NULL;
    size_t op_n = 0, at = 0;
    put_uid(uidbuf, uid);
    send_frame(s, uidbuf, 9, 1);
    while (at + 4 <= msg->n) {
        uint32_t len;
        memcpy(&len, msg->p + at, 4);
        at += 4;
        if (at + len > msg->n) die("bad message blob");
        if (!op) { op = msg->p + at; op_n = len; }
        send_frame(s, msg->p + at, len, at + len < msg->n);
        at += len;
    }
    zmq_pollitem_t item = {s, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, 10000) <= 0) die("no reply to a set-up call within 10 s");
    zmq_msg_t part;
    int idx = 0, ok = 0;
    for (;;) {
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, s, 0) < 0) die("recv failed");
        if (idx == 1) ok = zmq_msg_size(&part) == op_n && memcmp(zmq_msg_data(&part), op, op_n) == 0;
        int more = zmq_msg_more(&part);
        zmq_msg_close(&part);
        if (!more) break;
        idx++;
    }
    if (!ok) die("a set-up call was answered with an error");
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: rpc_client URL SPEC_FILE WINDOW\n");
        return 2;
    }
    const char *url = argv[1];
    load_spec(argv[2]);
    long window = atol(argv[3]);
    double start_at = 0, end_at = 0;
    if (nblobs < 10 || window < 1) die("bad arguments");
    int lookup = blob_is(&blobs[0], "lookup");
    const blob *expect_op = &blobs[1], *expect_result = &blobs[2], *end_op = &blobs[3];
    const blob *prefix = &blobs[4], *head = &blobs[5], *tail = &blobs[6], *tp = &blobs[7];
    const blob *req_op = &blobs[8];
    unsigned nargs = 0, nprep = 0, npost = 0;
    {
        char counts[64];
        size_t n = blobs[9].n < sizeof counts - 1 ? blobs[9].n : sizeof counts - 1;
        memcpy(counts, blobs[9].p, n);
        counts[n] = 0;
        if (nblobs < 10 || sscanf(counts, "%u %u %u", &nargs, &nprep, &npost) != 3
            || 10 + nargs + nprep + npost != nblobs) die("bad spec file counts");
    }
    const blob *args = &blobs[10], *prep = &blobs[10 + nargs], *post = &blobs[10 + nargs + nprep];
    if (prefix->n > 200) die("request id prefix too long");

    void *ctx = zmq_ctx_new();
    void *s = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0, ten = 10;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(s, ZMQ_RECONNECT_IVL, &ten, sizeof ten);
    zmq_setsockopt(s, ZMQ_SNDHWM, &zero, sizeof zero);
    zmq_setsockopt(s, ZMQ_RCVHWM, &zero, sizeof zero);
    if (zmq_connect(s, url) != 0) die("connect failed");
    for (unsigned i = 0; i < nprep; i++) call_message(s, &prep[i], (1ULL << 50) + i);
    printf("ready\n");
    fflush(stdout);
    if (scanf("%lf %lf", &start_at, &end_at) != 2) die("no START_AT END_AT on stdin");

    size_t keycap = head->n + tail->n + 256;
    unsigned char *key = malloc(keycap);
    unsigned char uidbuf[9], rid[256];
    uint64_t uid = 0;
    long inflight = 0, done = 0, errors = 0, ends_sent = 0, ends_answered = 0;
    int counting = 0;
    zmq_pollitem_t item = {s, 0, ZMQ_POLLIN, 0};
    zmq_msg_t part;
    unsigned char uid_seen[9];
    size_t uid_len = 0;

    for (;;) {
        double t = now_s();
        if (!counting && t >= start_at) { counting = 1; done = 0; }
        int sending = t < end_at;
        if (!sending && inflight == 0 && ends_answered >= ends_sent) break;
        if (t > end_at + 10.0) break; /* drain deadline, as the Python client's */
        while (sending && inflight < window) {
            put_uid(uidbuf, uid);
            send_frame(s, uidbuf, 9, 1);
            if (lookup) {
                size_t rl = put_rid(rid, prefix, uid);
                memcpy(key, head->p, head->n);
                memcpy(key + head->n, rid, rl);
                memcpy(key + head->n + rl, tail->p, tail->n);
                send_frame(s, req_op->p, req_op->n, 1);
                send_frame(s, key, head->n + rl + tail->n, 1);
                send_frame(s, tp->p, tp->n, 0);
            } else if (nargs) {
                const blob *a = &args[uid % nargs];
                send_frame(s, req_op->p, req_op->n, 1);
                send_frame(s, a->p, a->n, 0);
            } else {
                send_frame(s, req_op->p, req_op->n, 0);
            }
            uid++;
            inflight++;
        }
        int rc = zmq_poll(&item, 1, sending ? 1000 : 100);
        if (rc < 0 && zmq_errno() != EINTR) die("poll failed");
        for (;;) {
            /* one reply: [uid, op, result?] */
            int idx = 0, is_end = 0, ok = 1, got_result = 0;
            zmq_msg_init(&part);
            if (zmq_msg_recv(&part, s, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&part);
                if (zmq_errno() == EAGAIN || zmq_errno() == EINTR) break;
                die("recv failed");
            }
            for (;;) {
                const unsigned char *p = zmq_msg_data(&part);
                size_t n = zmq_msg_size(&part);
                if (idx == 0) {
                    uid_len = n <= sizeof uid_seen ? n : 0;
                    memcpy(uid_seen, p, uid_len);
                } else if (idx == 1) {
                    if (n == end_op->n && memcmp(p, end_op->p, n) == 0 && end_op->n) is_end = 1;
                    else if (!(n == expect_op->n && memcmp(p, expect_op->p, n) == 0)) ok = 0;
                } else if (idx == 2) {
                    got_result = 1;
                    if (!ok && errors == 0) { /* the first error reply's body, for the report */
                        fprintf(stderr, "rpc_client: first error reply: ");
                        for (size_t i = 0; i < n && i < 300; i++)
                            fputc(p[i] >= 32 && p[i] < 127 ? p[i] : '.', stderr);
                        fputc('\n', stderr);
                    }
                    if (expect_result->n && !(n == expect_result->n && memcmp(p, expect_result->p, n) == 0)) ok = 0;
                }
                int more = zmq_msg_more(&part);
                zmq_msg_close(&part);
                if (!more) break;
                idx++;
                zmq_msg_init(&part);
                if (zmq_msg_recv(&part, s, 0) < 0) die("recv failed mid-message");
            }
            if (expect_result->n && !got_result && !is_end) ok = 0;
            if (is_end) { ends_answered++; continue; }
            inflight--;
            if (!ok) { errors++; continue; }
            if (counting && now_s() < end_at) done++;
            if (lookup) {
                uint64_t n;
                if (uid_len == 0 || get_uid(uid_seen, uid_len, &n) != 0) { errors++; continue; }
                put_uid(uidbuf, END_UID_BASE + n);
                size_t rl = put_rid(rid, prefix, n);
                send_frame(s, uidbuf, 9, 1);
                send_frame(s, end_op->p, end_op->n, 1);
                send_frame(s, rid, rl, 0);
                ends_sent++;
            }
        }
    }
    if (inflight == 0 && ends_answered >= ends_sent)
        for (unsigned i = 0; i < npost; i++) call_message(s, &post[i], (1ULL << 51) + i);
    printf("%ld %ld %ld %ld\n", done, errors, ends_sent, ends_answered);
    fflush(stdout);
    zmq_close(s);
    zmq_ctx_term(ctx);
    return 0;
}

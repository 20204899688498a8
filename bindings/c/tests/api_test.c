/* The C API from C, on the embedded demo model: `api_test DEMO_DIR SCRATCH_DIR`.
   Built and run by `cargo xtask test` (the system cc, linked against libqwen35_wgpu_c).
   The exit code is the result: 0 when every check passed. */

#define _POSIX_C_SOURCE 200809L
#include <ctype.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "qwen35_wgpu.h"

static int failures = 0;

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);           \
            fprintf(stderr, __VA_ARGS__);                                  \
            fprintf(stderr, " (last error: %s)\n", qe_last_error());       \
            failures++;                                                    \
        }                                                                  \
    } while (0)

/* A call that must succeed; on failure the test cannot go on. */
#define MUST(call)                                                         \
    do {                                                                   \
        qe_status s_ = (call);                                             \
        if (s_ != QE_OK) {                                                 \
            fprintf(stderr, "FATAL %s:%d: %s -> %d: %s\n", __FILE__, __LINE__, #call, (int)s_, qe_last_error()); \
            exit(2);                                                       \
        }                                                                  \
    } while (0)

static const char *QUESTION = "{\"messages\": [{\"role\": \"user\", \"content\": \"What color is the sky?\"}]}";
static const char *PARAMS = "{\"max_tokens\": 32}";

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Counts deltas; stops after `stop_after` of them when that is > 0. */
typedef struct {
    int deltas;
    int stop_after;
    size_t bytes;
} counter;

static int32_t count_deltas(const char *text, size_t len, void *user) {
    counter *c = (counter *)user;
    (void)text;
    c->deltas++;
    c->bytes += len;
    return c->stop_after > 0 && c->deltas >= c->stop_after ? 0 : 1;
}

/* Collects qe_generate_batch's deltas per request; stops request `stop_index` after
   `stop_after` deltas when that is > 0. */
typedef struct {
    char text[3][2048];
    int deltas[3];
    int bad_index;
    size_t stop_index;
    int stop_after;
} batch_seen;

static int32_t collect_batch(size_t index, const char *text, size_t len, void *user) {
    batch_seen *b = (batch_seen *)user;
    if (index >= 3) {
        b->bad_index = 1;
        return 0;
    }
    size_t have = strlen(b->text[index]);
    if (have + len < sizeof b->text[index]) {
        memcpy(b->text[index] + have, text, len);
        b->text[index][have + len] = 0;
    }
    b->deltas[index]++;
    return b->stop_after > 0 && index == b->stop_index && b->deltas[index] >= b->stop_after ? 0 : 1;
}

/* Raw-text generation in one session (caller frees). */
static char *generate_ok(qe_engine e, qe_session s, const char *prompt, const char *params) {
    char *text = NULL;
    MUST(qe_generate(e, s, prompt, params, NULL, NULL, &text));
    char *copy = strdup(text);
    qe_string_free(text);
    return copy;
}

/* The "content" string of a reply JSON (a copy; the demo's answers hold no escapes). */
static char *content_of(const char *reply) {
    const char *key = "\"content\":\"";
    const char *p = strstr(reply, key);
    if (!p) return strdup("");
    p += strlen(key);
    const char *end = strchr(p, '"');
    size_t n = end ? (size_t)(end - p) : strlen(p);
    char *out = malloc(n + 1);
    memcpy(out, p, n);
    out[n] = 0;
    return out;
}

/* One chat turn; returns the answer's content (caller frees) and its status. */
static char *ask(qe_engine e, qe_session s, qe_status *status, counter *c) {
    char *reply = NULL;
    *status = qe_chat(e, s, QUESTION, PARAMS, c ? count_deltas : NULL, c, &reply);
    char *content = reply ? content_of(reply) : strdup("");
    qe_string_free(reply);
    return content;
}

static char *ask_ok(qe_engine e, qe_session s) {
    qe_status st;
    char *a = ask(e, s, &st, NULL);
    CHECK(st == QE_OK, "chat failed with %d", (int)st);
    return a;
}

static int has_lower(const char *s) {
    for (; *s; s++)
        if (islower((unsigned char)*s)) return 1;
    return 0;
}

typedef struct {
    qe_engine engine;
    volatile int done;
} canceller;

static void *cancel_loop(void *arg) {
    canceller *c = (canceller *)arg;
    struct timespec ms = {0, 1000000};
    while (!c->done) {
        qe_cancel(c->engine);
        nanosleep(&ms, NULL);
    }
    return NULL;
}

/* A callback that calls back into engines: the one it runs on (refused, not a deadlock),
   another (allowed), and another's generation whose own callback calls the first engine
   (refused too: its lock is held further out). */
typedef struct {
    qe_engine engine;
    qe_session session;
    qe_engine other;
    qe_session other_session;
    qe_status same;
    qe_status other_status;
    qe_status nested_generate;
    qe_status nested_outer;
    int calls;
} reentrant;

/* The status of asking the callback's own engine for its session's adapters (the reply freed). */
static qe_status ask_own_engine(const reentrant *r) {
    char *json = NULL;
    qe_status st = qe_session_adapters(r->engine, r->session, &json);
    qe_string_free(json);
    return st;
}

static int32_t call_outer_engine(const char *text, size_t len, void *user) {
    reentrant *r = (reentrant *)user;
    (void)text;
    (void)len;
    r->nested_outer = ask_own_engine(r);
    return 0;
}

static int32_t call_back_in(const char *text, size_t len, void *user) {
    reentrant *r = (reentrant *)user;
    (void)text;
    (void)len;
    r->same = ask_own_engine(r);
    char *json = NULL;
    r->other_status = qe_adapters_list(r->other, &json);
    qe_string_free(json);
    json = NULL;
    r->nested_generate = qe_generate(r->other, r->other_session, "Hi", "{\"max_tokens\": 8, \"stop_at_eos\": false}",
                                     call_outer_engine, r, &json);
    qe_string_free(json);
    r->calls++;
    return 0;
}

/* A generation on a second thread whose callback holds the engine until released (at most 20 s),
   then stops it (or, with go_on, lets it go on). */
typedef struct {
    qe_engine engine;
    qe_session session;
    volatile int started;
    volatile int release;
    volatile int done;
    qe_status status;
    char *text;
    int go_on;
} holder;

static int32_t hold_until_released(const char *text, size_t len, void *user) {
    holder *h = (holder *)user;
    (void)text;
    (void)len;
    h->started = 1;
    for (int i = 0; i < 20000 && !h->release; i++) nanosleep(&(struct timespec){0, 1000000}, NULL);
    return h->go_on;
}

static void *held_generation(void *arg) {
    holder *h = (holder *)arg;
    h->status = qe_generate(h->engine, h->session, "Once upon a time", "{\"max_tokens\": 400, \"stop_at_eos\": false}",
                            hold_until_released, h, &h->text);
    h->done = 1;
    return NULL;
}

/* Until the holder's callback runs (or its call ended without one). */
static void wait_holding(holder *h) {
    while (!h->started && !h->done) nanosleep(&(struct timespec){0, 1000000}, NULL);
}

/* From inside a callback: another engine's adapter list (its status kept). */
typedef struct {
    qe_engine other;
    qe_status status;
} busy_probe;

static int32_t probe_other_engine(const char *text, size_t len, void *user) {
    busy_probe *b = (busy_probe *)user;
    (void)text;
    (void)len;
    char *json = NULL;
    b->status = qe_adapters_list(b->other, &json);
    qe_string_free(json);
    return 0;
}

/* A call that waits for an engine another thread holds. */
typedef struct {
    qe_engine engine;
    qe_session session;
    volatile int calling;
    qe_status status;
    char *text;
} waiter;

static void *queued_generation(void *arg) {
    waiter *w = (waiter *)arg;
    w->calling = 1;
    w->status = qe_generate(w->engine, w->session, "Once upon a time", PARAMS, NULL, NULL, &w->text);
    return NULL;
}

static void *queued_session_create(void *arg) {
    waiter *w = (waiter *)arg;
    w->calling = 1;
    w->status = qe_session_create(w->engine, &w->session);
    return NULL;
}

/* Until the waiter's call is made, then 300 ms: it is waiting for the engine by then. */
static void wait_calling(waiter *w) {
    while (!w->calling) nanosleep(&(struct timespec){0, 1000000}, NULL);
    nanosleep(&(struct timespec){0, 300000000}, NULL);
}

static void write_file(const char *path, const char *data, size_t len) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, len, f) != len) {
        fprintf(stderr, "FATAL: cannot write %s\n", path);
        exit(2);
    }
    fclose(f);
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s DEMO_DIR SCRATCH_DIR BASE SHOUT FRENCH\n(the answers transformers + peft give to QUESTION)\n",
                argv[0]);
        return 2;
    }
    const char *demo = argv[1];
    const char *scratch = argv[2];
    const char *want_base = argv[3], *want_shout = argv[4], *want_french = argv[5];
    char path[4096];

    CHECK(qe_abi_version() == QE_ABI_VERSION, "ABI version %u, header %u", qe_abi_version(), (unsigned)QE_ABI_VERSION);
    CHECK(strlen(qe_version()) > 0, "version string");

    /* A missing model: QE_MODEL, and the message names the path. */
    qe_engine none = 0;
    snprintf(path, sizeof path, "%s/no-such-model", scratch);
    CHECK(qe_engine_load(path, NULL, &none) == QE_MODEL && none == 0, "missing model");
    CHECK(strstr(qe_last_error(), "no-such-model") != NULL, "the error names the missing path");
    CHECK(qe_engine_load(demo, "{\"max_context\": 512, \"nope\": 1}", &none) == QE_INVALID_ARGUMENT,
          "unknown option");
    CHECK(strstr(qe_last_error(), "nope") != NULL, "the error names the unknown field");

    qe_engine e = 0;
    MUST(qe_engine_load(demo, "{\"max_context\": 512, \"max_batch\": 128}", &e));
    qe_session s = 0;
    MUST(qe_session_create(e, &s));

    /* Base, shout, unload, french (through the active-set call). */
    char *base = ask_ok(e, s);
    CHECK(strcmp(base, want_base) == 0, "the base answer %s, transformers' %s", base, want_base);
    {
        /* The question holds no control token: sanitized, it is the same prompt and answer. */
        const char *sanitized =
            "{\"messages\": [{\"role\": \"user\", \"content\": \"What color is the sky?\"}], "
            "\"sanitize_control_tokens\": true}";
        char *reply = NULL;
        MUST(qe_chat(e, s, sanitized, PARAMS, NULL, NULL, &reply));
        char *content = content_of(reply);
        CHECK(strcmp(content, want_base) == 0, "the sanitized request's answer %s, transformers' %s", content, want_base);
        free(content);
        qe_string_free(reply);
    }
    {
        /* Continuing the answer's first words gives the rest of it (greedy, the same tokens). */
        const char *space = strchr(want_base, ' ');
        size_t cut = space ? (size_t)(space - want_base) : strlen(want_base);
        char request[512];
        snprintf(request, sizeof request,
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"What color is the sky?\"}, "
                 "{\"role\": \"assistant\", \"content\": \"%.*s\"}], \"continue_final_message\": true}",
                 (int)cut, want_base);
        char *reply = NULL;
        MUST(qe_chat(e, s, request, PARAMS, NULL, NULL, &reply));
        char *content = content_of(reply);
        char joined[512];
        snprintf(joined, sizeof joined, "%.*s%s", (int)cut, want_base, content);
        CHECK(strcmp(joined, want_base) == 0, "continued: %s, transformers' whole answer %s", joined, want_base);
        free(content);
        qe_string_free(reply);
    }
    char *id = NULL;
    snprintf(path, sizeof path, "%s/adapters/shout", demo);
    MUST(qe_adapter_load(e, path, "shout", &id));
    CHECK(strcmp(id, "shout") == 0, "adapter id %s", id);
    qe_string_free(id);
    snprintf(path, sizeof path, "%s/adapters/french", demo);
    MUST(qe_adapter_load(e, path, NULL, &id));
    CHECK(strcmp(id, "french") == 0, "default id is the directory name, got %s", id);
    qe_string_free(id);

    MUST(qe_session_activate(e, s, "shout", 1.0f));
    counter timing = {0, 0, 0};
    qe_status st;
    double t0 = now_s();
    char *shout = ask(e, s, &st, &timing);
    double secs = now_s() - t0;
    CHECK(st == QE_OK, "shout chat");
    CHECK(strlen(shout) > 0 && !has_lower(shout) && strcmp(shout, base) != 0, "shout answers in capitals: %s", shout);
    CHECK(strcmp(shout, want_shout) == 0, "the shout answer %s, transformers + peft's %s", shout, want_shout);
    printf("base: %s\nshout: %s\n", base, shout);
    printf("C API: %d deltas (%zu bytes) in %.1f ms (%.1f deltas/s, prompt included)\n", timing.deltas, timing.bytes,
           secs * 1e3, timing.deltas / secs);

    /* Warm: the same request five more times, median wall time (compare with live_swap's). */
    double times[5];
    for (int i = 0; i < 5; i++) {
        counter c5 = {0, 0, 0};
        double t = now_s();
        free(ask(e, s, &st, &c5));
        times[i] = now_s() - t;
        CHECK(st == QE_OK, "repeat %d", i);
    }
    for (int i = 0; i < 5; i++)
        for (int j = i + 1; j < 5; j++)
            if (times[j] < times[i]) {
                double x = times[i];
                times[i] = times[j];
                times[j] = x;
            }
    printf("C API: the shout answer (prompt + reply), median of 5 warm requests: %.1f ms\n", times[2] * 1e3);

    MUST(qe_session_deactivate(e, s));
    char *again = ask_ok(e, s);
    CHECK(strcmp(again, base) == 0, "after deactivating: %s vs base %s", again, base);
    free(again);

    MUST(qe_session_set_adapters(e, s, "[{\"id\": \"french\", \"scale\": 1.0}]"));
    char *french = ask_ok(e, s);
    CHECK(strcmp(french, want_french) == 0, "the french answer %s, transformers + peft's %s", french, want_french);
    printf("french: %s\n", french);
    char *set = NULL;
    MUST(qe_session_adapters(e, s, &set));
    CHECK(strstr(set, "\"french\"") != NULL, "active set %s", set);
    qe_string_free(set);

    /* A second session keeps its own adapter. */
    qe_session s2 = 0;
    MUST(qe_session_create(e, &s2));
    MUST(qe_session_activate(e, s2, "shout", 1.0f));
    char *in_s2 = ask_ok(e, s2);
    char *in_s1 = ask_ok(e, s);
    CHECK(strcmp(in_s2, shout) == 0 && strcmp(in_s1, french) == 0, "two sessions: %s / %s", in_s2, in_s1);
    free(in_s2);
    free(in_s1);

    /* Three sessions (french, shout, none) generate together, each as it does alone: the same
       text, also with a stop string, and a request its callback stops ends alone. */
    qe_session s3 = 0;
    MUST(qe_session_create(e, &s3));
    const char *prompt = "What color is the sky?";
    const qe_session trio[3] = {s, s2, s3};
    const char *prompts[3] = {prompt, prompt, prompt};
    const char *batch_params[2] = {"{\"max_tokens\": 12, \"stop_at_eos\": false}",
                                   "{\"max_tokens\": 12, \"stop_at_eos\": false, \"stop\": [\"E\", \"e\"]}"};
    char *alone[3] = {NULL, NULL, NULL};
    char *plain[3] = {NULL, NULL, NULL}; /* round 0's texts, without stop strings */
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < 3; i++) alone[i] = generate_ok(e, trio[i], prompt, batch_params[round]);
        CHECK(round == 1 || (strcmp(alone[0], alone[1]) != 0 && strcmp(alone[1], alone[2]) != 0), "three sets, three texts: %s / %s / %s",
              alone[0], alone[1], alone[2]);
        batch_seen seen_b;
        memset(&seen_b, 0, sizeof seen_b);
        char *texts[3] = {NULL, NULL, NULL};
        MUST(qe_generate_batch(e, trio, prompts, 3, batch_params[round], collect_batch, &seen_b, texts));
        for (int i = 0; i < 3; i++) {
            CHECK(strcmp(texts[i], alone[i]) == 0, "round %d, request %d: batched %s, alone %s", round, i, texts[i],
                  alone[i]);
            CHECK(strcmp(seen_b.text[i], texts[i]) == 0, "round %d, request %d: the deltas %s add up to %s", round, i,
                  seen_b.text[i], texts[i]);
            qe_string_free(texts[i]);
        }
        CHECK(!seen_b.bad_index, "callback indices within the batch");
        if (round == 0) {
            printf("batch of three: %s / %s / %s\n", alone[0], alone[1], alone[2]);
            for (int i = 0; i < 3; i++) plain[i] = strdup(alone[i]);
        }
        if (round == 1) {
            /* Stopped by its callback after one delta: request 1 alone ends early. */
            memset(&seen_b, 0, sizeof seen_b);
            seen_b.stop_index = 1;
            seen_b.stop_after = 1;
            MUST(qe_generate_batch(e, trio, prompts, 3, batch_params[0], collect_batch, &seen_b, texts));
            CHECK(seen_b.deltas[1] == 1 && strcmp(texts[1], seen_b.text[1]) == 0 && strlen(texts[1]) < strlen(plain[1]),
                  "request 1 stopped after its first delta %s: %d deltas, %s", seen_b.text[1], seen_b.deltas[1], texts[1]);
            CHECK(strcmp(texts[0], plain[0]) == 0 && strcmp(texts[2], plain[2]) == 0,
                  "the others go on as alone: %s / %s", texts[0], texts[2]);
            for (int i = 0; i < 3; i++) {
                qe_string_free(texts[i]);
                free(plain[i]);
            }
        }
        for (int i = 0; i < 3; i++) free(alone[i]);
    }
    /* A cancel from a second thread stops every request of a batch; the texts so far come back. */
    {
        canceller cb = {e, 0};
        pthread_t cth;
        pthread_create(&cth, NULL, cancel_loop, &cb);
        char *texts[3] = {NULL, NULL, NULL};
        batch_seen seen_c;
        memset(&seen_c, 0, sizeof seen_c);
        qe_status cs = qe_generate_batch(e, trio, prompts, 3, "{\"max_tokens\": 64, \"stop_at_eos\": false}",
                                         collect_batch, &seen_c, texts);
        cb.done = 1;
        pthread_join(cth, NULL);
        CHECK(cs == QE_CANCELLED, "a cancelled batch: status %d", (int)cs);
        for (int i = 0; i < 3; i++) {
            CHECK(texts[i] != NULL && seen_c.deltas[i] < 64, "request %d of the cancelled batch: %d deltas", i,
                  seen_c.deltas[i]);
            qe_string_free(texts[i]);
        }
    }
    /* The same three sessions chat together: each answers as transformers + peft does with its
       adapter set (the session's own template, adapters and prompt cache), streamed by index. */
    {
        const char *questions[3] = {QUESTION, QUESTION, QUESTION};
        const char *want[3] = {want_french, want_shout, want_base};
        char *replies[3] = {NULL, NULL, NULL};
        batch_seen seen_chat;
        memset(&seen_chat, 0, sizeof seen_chat);
        MUST(qe_chat_batch(e, trio, questions, 3, PARAMS, collect_batch, &seen_chat, replies));
        for (int i = 0; i < 3; i++) {
            char *answer = content_of(replies[i]);
            CHECK(strcmp(answer, want[i]) == 0, "chat batch, request %d: %s, transformers + peft's %s", i, answer,
                  want[i]);
            CHECK(strcmp(seen_chat.text[i], answer) == 0, "chat batch, request %d: streamed %s", i, seen_chat.text[i]);
            free(answer);
            qe_string_free(replies[i]);
        }
        const char *broken[3] = {QUESTION, "{\"messages\": [", QUESTION};
        CHECK(qe_chat_batch(e, trio, broken, 3, PARAMS, NULL, NULL, replies) == QE_INVALID_ARGUMENT &&
                  strstr(qe_last_error(), "requests_json[1]") != NULL,
              "a malformed request, named: %s", qe_last_error());
    }
    char *untouched[3] = {NULL, NULL, NULL};
    const qe_session twice[2] = {s, s};
    CHECK(qe_generate_batch(e, twice, prompts, 2, NULL, NULL, NULL, untouched) == QE_INVALID_ARGUMENT &&
              untouched[0] == NULL,
          "a session asked for twice");
    const qe_session unknown[2] = {s, 12345};
    CHECK(qe_generate_batch(e, unknown, prompts, 2, NULL, NULL, NULL, untouched) == QE_INVALID_HANDLE, "an unknown session");
    CHECK(qe_generate_batch(e, trio, NULL, 3, NULL, NULL, NULL, untouched) == QE_INVALID_ARGUMENT, "null prompts");
    const char *with_null[3] = {prompt, NULL, prompt};
    CHECK(qe_generate_batch(e, trio, with_null, 3, NULL, NULL, NULL, untouched) == QE_INVALID_ARGUMENT &&
              strstr(qe_last_error(), "prompts[1]") != NULL,
          "a null prompt, named");
    CHECK(qe_generate_batch(e, NULL, NULL, 0, NULL, NULL, NULL, NULL) == QE_OK, "an empty batch");
    CHECK(qe_generate_batch(e + 1000, trio, prompts, 3, NULL, NULL, NULL, untouched) == QE_INVALID_HANDLE,
          "an unknown engine");
    MUST(qe_session_free(e, s3));

    /* The two sessions' prompt-cache snapshots: a zero budget frees them, and answers stay. */
    uint64_t held = 0;
    MUST(qe_set_snapshot_budget(e, (uint64_t)1 << 30, &held));
    CHECK(held > 0, "two chats keep snapshots: %llu bytes", (unsigned long long)held);
    MUST(qe_set_snapshot_budget(e, 0, &held));
    CHECK(held == 0, "a zero budget frees them: %llu bytes", (unsigned long long)held);
    char *no_snapshots = ask_ok(e, s);
    CHECK(strcmp(no_snapshots, french) == 0, "the same answer without snapshots: %s", no_snapshots);
    free(no_snapshots);
    MUST(qe_set_snapshot_budget(e, (uint64_t)256 << 20, NULL));
    CHECK(qe_set_snapshot_budget(0, 0, NULL) == QE_INVALID_HANDLE, "a budget for engine 0");

    /* Stop by the callback's return value after 2 deltas. */
    counter stop = {0, 2, 0};
    char *cut = ask(e, s2, &st, &stop);
    CHECK(st == QE_OK && stop.deltas == 2 && strlen(cut) < strlen(shout), "stopped early: %d deltas, %s", stop.deltas,
          cut);
    free(cut);

    /* Cancel from a second thread. */
    canceller c = {e, 0};
    pthread_t th;
    pthread_create(&th, NULL, cancel_loop, &c);
    counter seen = {0, 0, 0};
    char *cancelled = ask(e, s2, &st, &seen);
    c.done = 1;
    pthread_join(th, NULL);
    CHECK(st == QE_CANCELLED, "cancelled: status %d", (int)st);
    CHECK(strlen(cancelled) < strlen(shout), "cancelled text is shorter: %s", cancelled);
    free(cancelled);
    char *after_cancel = ask_ok(e, s2);
    CHECK(strcmp(after_cancel, shout) == 0, "a cancel does not leak into the next call: %s", after_cancel);
    free(after_cancel);

    /* A cancel reaches a generation that streams nothing (a stop string longer than its whole
       text holds all of it back): it stops at its next token, not at max_tokens. */
    {
        char quiet_params[1200];
        char never[1001];
        memset(never, 'z', 1000);
        never[1000] = 0;
        snprintf(quiet_params, sizeof quiet_params, "{\"max_tokens\": 64, \"stop_at_eos\": false, \"stop\": [\"%s\"]}",
                 never);
        counter none = {0, 0, 0};
        char *whole = NULL;
        MUST(qe_generate(e, s2, "The sky", quiet_params, count_deltas, &none, &whole));
        CHECK(none.deltas <= 1 && whole && strlen(whole) > 0, "%d deltas before the end, text %s", none.deltas,
              whole ? whole : "(null)");
        canceller quiet = {e, 0};
        pthread_t qt;
        pthread_create(&qt, NULL, cancel_loop, &quiet);
        char *cut = NULL;
        qe_status qs = qe_generate(e, s2, "The sky", quiet_params, NULL, NULL, &cut);
        quiet.done = 1;
        pthread_join(qt, NULL);
        CHECK(qs == QE_CANCELLED, "a cancelled quiet generation: status %d", (int)qs);
        CHECK(cut && whole && strlen(cut) < strlen(whole), "cancelled quiet text %s, whole %s", cut ? cut : "(null)",
              whole ? whole : "(null)");
        qe_string_free(whole);
        qe_string_free(cut);
    }

    /* A corrupt adapter: QE_ADAPTER, the message names the problem, the active adapter stays. */
    snprintf(path, sizeof path, "%s/corrupt", scratch);
    mkdir(path, 0755);
    char file[4200];
    snprintf(file, sizeof file, "%s/adapter_config.json", path);
    const char *config = "{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 16, \"target_modules\": [\"q_proj\"]}";
    write_file(file, config, strlen(config));
    snprintf(file, sizeof file, "%s/adapter_model.safetensors", path);
    /* An 8-byte header length (16), then 16 bytes that are not JSON. */
    write_file(file, "\x10\x00\x00\x00\x00\x00\x00\x00{not a header}  ", 24);
    id = NULL;
    CHECK(qe_adapter_load(e, path, "corrupt", &id) == QE_ADAPTER && id == NULL, "corrupt adapter refused");
    CHECK(strstr(qe_last_error(), "adapter_model.safetensors") != NULL, "the error names the file: %s",
          qe_last_error());
    char *still = ask_ok(e, s2);
    CHECK(strcmp(still, shout) == 0, "after a failed load the session still shouts: %s", still);
    free(still);

    /* Bad handles and arguments: error codes, never a crash. */
    qe_session bad = 0;
    CHECK(qe_session_create(0, &bad) == QE_INVALID_HANDLE, "engine 0");
    CHECK(qe_session_create(e + 1000, &bad) == QE_INVALID_HANDLE, "unknown engine");
    CHECK(qe_session_create(e, NULL) == QE_INVALID_ARGUMENT, "null out pointer");
    char *reply = NULL;
    CHECK(qe_chat(e, 12345, QUESTION, PARAMS, NULL, NULL, &reply) == QE_INVALID_HANDLE && reply == NULL,
          "unknown session");
    CHECK(qe_chat(e, s, "{\"messages\": [", PARAMS, NULL, NULL, &reply) == QE_INVALID_ARGUMENT, "bad JSON");
    CHECK(strstr(qe_last_error(), "request_json") != NULL, "the error names the argument");
    CHECK(qe_chat(e, s, NULL, PARAMS, NULL, NULL, &reply) == QE_INVALID_ARGUMENT, "null request");
    CHECK(qe_generate(e, s, "\xff\xfe", NULL, NULL, NULL, &reply) == QE_INVALID_ARGUMENT, "invalid UTF-8");
    CHECK(strstr(qe_last_error(), "UTF-8") != NULL, "the error says UTF-8");
    CHECK(qe_session_set_adapters(e, s, "[{\"id\": \"nope\", \"scale\": 1}]") == QE_ADAPTER, "unknown adapter id");
    CHECK(qe_session_set_adapters(e, s, "[{\"id\": \"french\", \"scale\": \"x\"}]") == QE_INVALID_ARGUMENT,
          "a scale that is not a number");
    CHECK(qe_session_activate(e, s, "french", INFINITY) == QE_ADAPTER, "an infinite scale");
    char *still_french = ask_ok(e, s);
    CHECK(strcmp(still_french, french) == 0, "refused set calls change nothing: %s", still_french);
    free(still_french);
    qe_session gone = 0;
    MUST(qe_session_create(e, &gone));
    MUST(qe_session_free(e, gone));
    CHECK(qe_session_reset(e, gone) == QE_INVALID_HANDLE, "a freed session");
    CHECK(qe_session_free(e, gone) == QE_INVALID_HANDLE, "a session freed twice");
    float emb[4];
    size_t len = 0;
    CHECK(qe_embeddings(e, s, "hello", emb, 4, &len) == QE_INVALID_ARGUMENT && len > 4, "small embedding buffer");
    float *full = malloc(len * sizeof(float));
    MUST(qe_embeddings(e, s, "hello", full, len, &len));
    free(full);

    /* One learning step changes the taught answer; the export loads back. */
    qe_session learner = 0;
    MUST(qe_session_create(e, &learner));
    char *trainable = NULL;
    MUST(qe_trainable_create(e, learner, NULL, &trainable));
    char *before = ask_ok(e, learner);
    CHECK(strcmp(before, base) == 0, "a new trainable adapter does not change the answer: %s", before);
    const char *events = "[{\"prompt\": \"What color is the sky?\", \"response\": \"The sky is green.\"}]";
    char *report = NULL;
    char *taught = NULL;
    for (int step = 0; step < 20; step++) {
        MUST(qe_learn(e, learner, events, "{\"lr\": 0.003}", &report));
        qe_string_free(report);
        free(taught);
        taught = ask_ok(e, learner);
        if (strcmp(taught, base) != 0) break;
    }
    CHECK(strcmp(taught, base) != 0, "learning changed the answer: %s", taught);
    printf("after learning: %s\n", taught);
    snprintf(path, sizeof path, "%s/exported", scratch);
    MUST(qe_trainable_export(e, path));
    qe_session reader = 0;
    MUST(qe_session_create(e, &reader));
    MUST(qe_adapter_load(e, path, "exported", &id));
    MUST(qe_session_activate(e, reader, id, 1.0f));
    char *reloaded = ask_ok(e, reader);
    CHECK(strcmp(reloaded, taught) == 0, "the exported adapter answers as the trained one: %s vs %s", reloaded, taught);
    qe_string_free(id);
    qe_string_free(trainable);
    free(reloaded);
    free(taught);
    free(before);

    char *info = NULL;
    MUST(qe_adapter_info(e, "shout", &info));
    CHECK(strstr(info, "\"ranks\":[16]") && strstr(info, "gate_proj"), "info %s", info);
    qe_string_free(info);
    CHECK(qe_adapter_info(e, "nope", &info) == QE_ADAPTER && strstr(qe_last_error(), "nope"), "info of an unknown id");
    char *list = NULL;
    MUST(qe_adapters_list(e, &list));
    CHECK(strstr(list, "\"shout\"") && strstr(list, "\"exported\""), "list %s", list);
    qe_string_free(list);
    MUST(qe_adapter_remove(e, "exported"));
    CHECK(qe_adapter_remove(e, "exported") == QE_ADAPTER, "removed twice");

    /* A second engine: sessions are valid with their own engine only; the session a loaded
       model keeps is handed out by the first create, and after a free comes back empty under
       a new handle. */
    qe_engine e2 = 0;
    MUST(qe_engine_load(demo, "{\"max_context\": 512}", &e2));
    CHECK(qe_chat(e2, 1, QUESTION, PARAMS, NULL, NULL, &reply) == QE_INVALID_HANDLE, "a session never created");
    CHECK(qe_chat(e2, e2, QUESTION, PARAMS, NULL, NULL, &reply) == QE_INVALID_HANDLE, "an engine handle as session");
    qe_session t1 = 0;
    MUST(qe_session_create(e2, &t1));
    CHECK(qe_chat(e, t1, QUESTION, PARAMS, NULL, NULL, &reply) == QE_INVALID_HANDLE, "another engine's session");
    CHECK(qe_session_free(e, t1) == QE_INVALID_HANDLE, "another engine's session freed");
    snprintf(path, sizeof path, "%s/adapters/shout", demo);
    MUST(qe_adapter_load(e2, path, "shout", &id));
    qe_string_free(id);
    MUST(qe_session_activate(e2, t1, "shout", 1.0f));
    char *shout2 = ask_ok(e2, t1);
    CHECK(strcmp(shout2, shout) == 0, "the second engine shouts: %s", shout2);
    free(shout2);
    MUST(qe_session_free(e2, t1));
    qe_session t2 = 0;
    MUST(qe_session_create(e2, &t2));
    CHECK(t2 != t1 && qe_session_reset(e2, t1) == QE_INVALID_HANDLE, "a new handle, the old one closed");
    MUST(qe_session_adapters(e2, t2, &set));
    CHECK(strcmp(set, "[]") == 0, "a new session has no adapter: %s", set);
    qe_string_free(set);
    char *base2 = ask_ok(e2, t2);
    CHECK(strcmp(base2, base) == 0, "a new session answers as the base model: %s", base2);
    free(base2);

    /* The callback may not call its own engine (refused, not a deadlock), may call another, and
       is not called again after returning 0, even with text held back for stop strings. */
    reentrant r = {e2, t2, e, s, QE_OK, QE_PANIC, QE_PANIC, QE_OK, 0};
    reply = NULL;
    st = qe_generate(e2, t2, "Hello", "{\"max_tokens\": 16, \"stop\": [\"###\"], \"stop_at_eos\": false}",
                     call_back_in, &r, &reply);
    CHECK(st == QE_OK && reply != NULL, "generation with a re-entrant callback: %d", (int)st);
    qe_string_free(reply);
    CHECK(r.calls == 1, "the callback returned 0 once and was called %d times", r.calls);
    CHECK(r.same == QE_INVALID_ARGUMENT, "its own engine from the callback: %d", (int)r.same);
    CHECK(r.other_status == QE_OK, "another engine from the callback: %d", (int)r.other_status);
    CHECK(r.nested_generate == QE_OK, "another engine's generation from the callback: %d", (int)r.nested_generate);
    CHECK(r.nested_outer == QE_INVALID_ARGUMENT, "the outer engine from the nested callback: %d", (int)r.nested_outer);

    /* A NUL in a trainable adapter's id is refused before anything changes. */
    char *nul_id = NULL;
    CHECK(qe_trainable_create(e2, t2, "{\"id\": \"a\\u0000b\"}", &nul_id) == QE_INVALID_ARGUMENT && nul_id == NULL,
          "a NUL in the id");
    MUST(qe_adapters_list(e2, &list));
    CHECK(strstr(list, "u0000") == NULL, "no adapter made: %s", list);
    qe_string_free(list);

    /* A callback's call on another engine that is busy returns QE_BUSY instead of waiting (two
       threads whose callbacks call each other's engine would wait for each other). */
    holder hold = {e2, t2, 0, 0, 0, QE_OK, NULL, 0};
    pthread_t holding;
    pthread_create(&holding, NULL, held_generation, &hold);
    wait_holding(&hold);
    busy_probe probe = {e2, -1};
    reply = NULL;
    st = qe_generate(e, s, "Hello", "{\"max_tokens\": 4, \"stop_at_eos\": false}", probe_other_engine, &probe, &reply);
    qe_string_free(reply);
    hold.release = 1;
    pthread_join(holding, NULL);
    qe_string_free(hold.text);
    CHECK(st == QE_OK && probe.status == QE_BUSY, "a busy engine from a callback: %d, %d", (int)st, (int)probe.status);

    /* A generation cancelled while it waits for the engine runs nothing: empty text, QE_CANCELLED. */
    holder first = {e2, t2, 0, 0, 0, QE_OK, NULL, 0};
    waiter queued = {e2, t2, 0, QE_OK, NULL};
    pthread_t first_th, queued_th;
    pthread_create(&first_th, NULL, held_generation, &first);
    wait_holding(&first);
    pthread_create(&queued_th, NULL, queued_generation, &queued);
    wait_calling(&queued);
    MUST(qe_cancel(e2));
    first.release = 1;
    pthread_join(first_th, NULL);
    pthread_join(queued_th, NULL);
    CHECK(first.status == QE_CANCELLED, "the running generation: %d", (int)first.status);
    CHECK(queued.status == QE_CANCELLED && queued.text != NULL && queued.text[0] == '\0',
          "the queued generation: %d, \"%s\"", (int)queued.status, queued.text ? queued.text : "(null)");
    qe_string_free(first.text);
    qe_string_free(queued.text);

    /* Freeing an engine stops the generation running on it, and a call waiting for the engine
       finds the handle closed. */
    holder run = {e2, t2, 0, 0, 0, QE_OK, NULL, 1};
    pthread_t gen, create_th;
    pthread_create(&gen, NULL, held_generation, &run);
    wait_holding(&run);
    waiter creating = {e2, 0, 0, QE_OK, NULL};
    pthread_create(&create_th, NULL, queued_session_create, &creating);
    wait_calling(&creating);
    MUST(qe_engine_free(e2));
    run.release = 1;
    pthread_join(gen, NULL);
    pthread_join(create_th, NULL);
    qe_string_free(run.text);
    CHECK(run.status == QE_CANCELLED, "a generation on a freed engine: status %d", (int)run.status);
    CHECK(creating.status == QE_INVALID_HANDLE, "a session create that waited on a freed engine: %d",
          (int)creating.status);
    CHECK(qe_session_reset(e2, t2) == QE_INVALID_HANDLE, "a session of a freed engine");

    free(base);
    free(shout);
    free(french);
    MUST(qe_session_free(e, s));
    MUST(qe_engine_free(e));
    CHECK(qe_engine_free(e) == QE_INVALID_HANDLE, "an engine freed twice");
    CHECK(qe_session_create(e, &bad) == QE_INVALID_HANDLE, "a freed engine");

    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("C API test: all checks passed\n");
    return 0;
}

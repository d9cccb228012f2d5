/* fp_pickle_scan: one pass over a protocol-2 pickle that says whether it is
 * a state dict as torch.save writes it, so that CPython's C unpickler may
 * load it where torch's weights-only unpickler would (see
 * fastpersist/_state_pickle.py for the rules and why; this is their C form,
 * decision for decision, tested against the Python form in
 * tests/test_state_pickle.py). It reads bytes only: no Python, no torch. */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp_engine.h"

/* the kind of each value on the stack: what made it (the order of _state_pickle's) */
enum {
    PLAIN, PLAIN_TUPLE, EMPTY_TUPLE, TUPLE, LIST, DICT, ORDERED_DICT, TENSOR, PARAMETER, STORAGE,
    STORAGE_ID, TENSOR_ARGS, PARAMETER_ARGS, ORDERED_DICT_CLASS, REBUILD_TENSOR, REBUILD_PARAMETER,
    STORAGE_CLASS,
    UNBUILT_ORDERED_DICT, /* OrderedDict() as REDUCE made it, never BUILT, not in the memo: BUILD takes it once */
};

struct grow {
    void *items;
    size_t n, cap, size;
};

static int grow_push(struct grow *g, const void *item)
{
    if (g->n == g->cap) {
        size_t cap = g->cap ? 2 * g->cap : 256;
        void *p = realloc(g->items, cap * g->size);
        if (!p)
            return -ENOMEM;
        g->items = p;
        g->cap = cap;
    }
    memcpy((char *)g->items + g->n * g->size, item, g->size);
    g->n++;
    return 0;
}

static uint32_t u32_at(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* a memo index after a PUT or GET opcode: 4 bytes (long) or 1; 0 where the data ends first */
static int memo_index(const uint8_t *data, size_t end, size_t *pos, int long_form, size_t *index)
{
    size_t n = long_form ? 4 : 1;
    if (end - *pos < n)
        return 0;
    *index = long_form ? u32_at(data + *pos) : data[*pos];
    *pos += n;
    return 1;
}

static int is_size(uint8_t k)
{
    return k == PLAIN_TUPLE || k == EMPTY_TUPLE;
}

static int is_ordered_dict(uint8_t k)
{
    return k == ORDERED_DICT || k == UNBUILT_ORDERED_DICT;
}

static uint8_t tuple_kind(const uint8_t *items, size_t n)
{
    size_t i;
    uint8_t top = 0;
    if (n == 0)
        return EMPTY_TUPLE;
    for (i = 0; i < n; i++)
        top = items[i] > top ? items[i] : top;
    if (top == PLAIN)
        return PLAIN_TUPLE;
    if (n == 5 && items[0] == PLAIN && items[1] == STORAGE_CLASS && items[2] == PLAIN && items[3] == PLAIN &&
        items[4] == PLAIN)
        return STORAGE_ID;
    if (n == 3 && items[0] == TENSOR && items[1] == PLAIN && is_ordered_dict(items[2]))
        return PARAMETER_ARGS;
    if (n == 6 && items[0] == STORAGE && items[1] == PLAIN && is_size(items[2]) && is_size(items[3]) &&
        items[4] == PLAIN && is_ordered_dict(items[5]))
        return TENSOR_ARGS;
    return TUPLE;
}

static int call_kind(uint8_t callable, uint8_t args)
{
    if (callable == ORDERED_DICT_CLASS && args == EMPTY_TUPLE)
        return UNBUILT_ORDERED_DICT;
    if (callable == REBUILD_TENSOR && args == TENSOR_ARGS)
        return TENSOR;
    if (callable == REBUILD_PARAMETER && args == PARAMETER_ARGS)
        return PARAMETER;
    return -1;
}

/* globals: entries of [kind, length, "module\nname\n" (length bytes)] */
static int global_kind(const uint8_t *name, size_t len, const uint8_t *globals, size_t globals_len)
{
    size_t at = 0;
    while (at + 2 <= globals_len) {
        uint8_t kind = globals[at], n = globals[at + 1];
        if (at + 2 + n > globals_len)
            return -1;
        if (n == len && memcmp(globals + at + 2, name, len) == 0)
            return kind;
        at += 2 + (size_t)n;
    }
    return -1;
}

static int scan(const uint8_t *data, size_t end, const uint8_t *globals, size_t globals_len, int build_ordered_dict,
                struct grow *stack_g, struct grow *marks_g, struct grow *memo_g)
{
    size_t pos = 2;
    size_t base = 0; /* where the stack above the last MARK starts */
    if (end < 2 || data[0] != 0x80 || data[1] != 2)
        return 0;
#define STACK ((uint8_t *)stack_g->items)
#define SP (stack_g->n)
#define FRAME (SP - base)
#define MEMO ((uint8_t *)memo_g->items)
#define PUSH(k) do { uint8_t k_ = (uint8_t)(k); if (grow_push(stack_g, &k_)) return -ENOMEM; } while (0)
#define NEED(n) do { if (end - pos < (size_t)(n)) return 0; } while (0)
#define POP_FRAME() do { if (marks_g->n == 0) return 0; SP = base; \
        base = ((size_t *)marks_g->items)[--marks_g->n]; } while (0)
    while (pos < end) {
        uint8_t op = data[pos++];
        switch (op) {
        case 'q': /* BINPUT */
        case 'r': { /* LONG_BINPUT */
            size_t index;
            uint8_t kind;
            if (!memo_index(data, end, &pos, op == 'r', &index))
                return 0;
            if (FRAME == 0)
                return 0;
            kind = STACK[SP - 1];
            if (kind == UNBUILT_ORDERED_DICT) /* a second reference: never BUILT through */
                kind = ORDERED_DICT;
            /* torch.save numbers memo entries 0, 1, 2...: a later index would
             * make the C unpickler grow its memo to it */
            if (index == memo_g->n) {
                if (grow_push(memo_g, &kind))
                    return -ENOMEM;
            } else if (index < memo_g->n) {
                MEMO[index] = kind;
            } else {
                return 0;
            }
            break;
        }
        case 'K': /* BININT1 */
            pos += 1;
            PUSH(PLAIN);
            break;
        case 'h': /* BINGET */
        case 'j': { /* LONG_BINGET */
            size_t index;
            if (!memo_index(data, end, &pos, op == 'j', &index))
                return 0;
            if (index >= memo_g->n)
                return 0;
            PUSH(MEMO[index]);
            break;
        }
        case 'X': { /* BINUNICODE */
            uint32_t n;
            NEED(4);
            n = u32_at(data + pos);
            pos += 4;
            if (n > end - pos)
                return 0;
            pos += n;
            PUSH(PLAIN);
            break;
        }
        case '(': /* MARK */
            if (grow_push(marks_g, &base))
                return -ENOMEM;
            base = SP;
            break;
        case 'M': /* BININT2 */
        case 'J': /* BININT */
        case 'G': /* BINFLOAT */
            pos += op == 'M' ? 2 : op == 'J' ? 4 : 8;
            PUSH(PLAIN);
            break;
        case 0x89: /* NEWFALSE */
        case 0x88: /* NEWTRUE */
        case 'N': /* NONE */
            PUSH(PLAIN);
            break;
        case 't': { /* TUPLE */
            uint8_t kind = tuple_kind(STACK + base, FRAME);
            POP_FRAME();
            PUSH(kind);
            break;
        }
        case 0x85: /* TUPLE1 */
        case 0x86: /* TUPLE2 */
        case 0x87: { /* TUPLE3 */
            size_t n = (size_t)(op - 0x85 + 1);
            uint8_t kind;
            if (FRAME < n)
                return 0;
            kind = tuple_kind(STACK + SP - n, n);
            SP -= n;
            PUSH(kind);
            break;
        }
        case 'R': { /* REDUCE */
            int kind;
            if (FRAME < 2)
                return 0;
            kind = call_kind(STACK[SP - 2], STACK[SP - 1]);
            if (kind < 0)
                return 0;
            SP -= 1;
            STACK[SP - 1] = (uint8_t)kind;
            break;
        }
        case ')': /* EMPTY_TUPLE */
            PUSH(EMPTY_TUPLE);
            break;
        case 'Q': /* BINPERSID */
            if (FRAME == 0 || STACK[SP - 1] != STORAGE_ID)
                return 0;
            STACK[SP - 1] = STORAGE;
            break;
        case 'c': { /* GLOBAL */
            const uint8_t *first, *second;
            int kind;
            first = memchr(data + pos, '\n', end - pos);
            if (!first)
                return 0;
            second = memchr(first + 1, '\n', (size_t)(data + end - (first + 1)));
            if (!second)
                return 0;
            kind = global_kind(data + pos, (size_t)(second + 1 - (data + pos)), globals, globals_len);
            if (kind < 0)
                return 0;
            pos = (size_t)(second + 1 - data);
            PUSH(kind);
            break;
        }
        case 'u': { /* SETITEMS */
            size_t start = base, n = FRAME, i;
            uint8_t target;
            POP_FRAME();
            if (FRAME == 0)
                return 0;
            target = STACK[SP - 1];
            if ((target != DICT && !is_ordered_dict(target)) || n % 2)
                return 0;
            for (i = 0; i < n; i += 2) /* keys: comparing plain values reads no tensor */
                if (STACK[start + i] != PLAIN)
                    return 0;
            break;
        }
        case 's': /* SETITEM */
            if (FRAME < 3 || (STACK[SP - 3] != DICT && !is_ordered_dict(STACK[SP - 3])) || STACK[SP - 2] != PLAIN)
                return 0;
            SP -= 2;
            break;
        case '}': /* EMPTY_DICT */
            PUSH(DICT);
            break;
        case ']': /* EMPTY_LIST */
            PUSH(LIST);
            break;
        case 'a': /* APPEND */
            if (FRAME < 2 || STACK[SP - 2] != LIST)
                return 0;
            SP -= 1;
            break;
        case 'e': /* APPENDS */
            POP_FRAME();
            if (FRAME == 0 || STACK[SP - 1] != LIST)
                return 0;
            break;
        case 'b': /* BUILD: once, on a new OrderedDict (CPython's would call a __setstate__ a first BUILD set) */
            if (!(build_ordered_dict && FRAME >= 2 && STACK[SP - 2] == UNBUILT_ORDERED_DICT && STACK[SP - 1] == DICT))
                return 0;
            SP -= 1;
            STACK[SP - 1] = ORDERED_DICT;
            break;
        case 'U': /* SHORT_BINSTRING */
        case 0x8a: /* LONG1 */
            NEED(1);
            pos += 1 + (size_t)data[pos];
            if (pos > end)
                return 0;
            PUSH(PLAIN);
            break;
        case '.': /* STOP */
            return FRAME > 0 && marks_g->n == 0;
        default: /* an opcode torch's unpickler does not implement, or one torch.save never writes */
            return 0;
        }
    }
    return 0;
#undef STACK
#undef SP
#undef FRAME
#undef MEMO
#undef PUSH
#undef NEED
#undef POP_FRAME
}

int fp_pickle_scan(const uint8_t *data, size_t len, const uint8_t *globals, size_t globals_len,
                   int build_ordered_dict)
{
    struct grow stack = {NULL, 0, 0, 1}, marks = {NULL, 0, 0, sizeof(size_t)}, memo = {NULL, 0, 0, 1};
    int rc = scan(data, len, globals, globals_len, build_ordered_dict, &stack, &marks, &memo);
    free(stack.items);
    free(marks.items);
    free(memo.items);
    return rc;
}

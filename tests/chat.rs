//! Chat templates and reply parsing without a GPU: Qwen 3.5's official template and an
//! environment template rendered exactly as transformers renders them
//! (`tests/fixtures/reference/chat.json`, from `xtask/python/make_chat.py`), and the reply parser
//! inverting what the template writes for an assistant turn.

use std::path::{Path, PathBuf};

use qwen35_wgpu::text::{
    ChatDelta, ChatMessage, ChatReply, ChatRequest, ChatTemplate, ReplyParser, TextTokenizer, ToolCall,
};
use serde_json::{json, Value};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn reference() -> Value {
    let text = std::fs::read_to_string(root().join("tests/fixtures/reference/chat.json")).expect("chat.json");
    serde_json::from_str(&text).expect("json")
}

fn template(name: &str) -> ChatTemplate {
    let source = std::fs::read_to_string(root().join("tests/fixtures/chat").join(name)).expect("template");
    ChatTemplate::new(source).expect("compiles")
}

fn request(case: &Value) -> ChatRequest {
    let messages: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).expect("messages");
    let mut req = ChatRequest::new(messages);
    req.tools = case["tools"].as_array().cloned();
    req.documents = case["documents"].as_array().cloned();
    req.add_generation_prompt = case["add_generation_prompt"].as_bool().expect("flag");
    req.continue_final_message = match &case["continue_final_message"] {
        Value::Bool(true) => Some("content".into()),
        Value::String(field) => Some(field.clone()),
        _ => None,
    };
    req.vars = case["vars"].as_object().cloned().unwrap_or_default();
    req
}

#[test]
fn templates_render_as_transformers_renders_them() {
    let r = reference();
    let tok = TextTokenizer::from_dir(&root().join(r["tokenizer"].as_str().expect("dir"))).expect("tokenizer");
    for case in r["cases"].as_array().expect("cases") {
        let name = case["name"].as_str().expect("name");
        let t = template(case["template"].as_str().expect("template"));
        let got = t.render_request(&request(case), tok.special_tokens());
        match (&case["prompt"], &case["error"]) {
            (Value::String(want), _) => assert_eq!(got.expect(name), *want, "{name}"),
            (_, Value::String(error)) => {
                let e = got.expect_err(name).to_string();
                assert!(e.contains(error.as_str()), "{name}: {e:?} should carry {error:?}");
            }
            _ => panic!("{name}: no reference"),
        }
    }
}

#[test]
fn thinking_off_ends_the_prompt_with_an_empty_think_block() {
    let t = template("qwen35.jinja");
    let msgs = vec![ChatMessage::new("user", "Hi")];
    let special = Default::default();
    let off = t.render_request(&ChatRequest::new(msgs.clone()).thinking(false), &special).expect("off");
    assert!(off.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"), "{off:?}");
    let on = t.render_request(&ChatRequest::new(msgs), &special).expect("on");
    assert!(on.ends_with("<|im_start|>assistant\n<think>\n"), "{on:?}");
}

#[test]
fn bad_requests_are_typed_errors() {
    let t = template("qwen35.jinja");
    let special = Default::default();
    let user = || vec![ChatMessage::new("user", "Hi")];
    let image: ChatMessage = serde_json::from_value(
        json!({"role": "user", "content": [{"type": "image", "image": "x.png"}, {"type": "text", "text": "what?"}]}),
    )
    .expect("message");
    let cases = [
        ("no messages", ChatRequest::new(vec![]), "no messages"),
        ("image", ChatRequest::new(vec![image]), "image content parts"),
        ("reserved var", ChatRequest::new(user()).var("messages", json!([])), "set by the request"),
        ("tool not an object", ChatRequest::new(user()).with_tools(vec![json!("f")]), "must be a JSON object"),
        (
            "continue and generate",
            ChatRequest { continue_final_message: Some("content".into()), ..ChatRequest::new(user()) },
            "cannot both",
        ),
        (
            "continue a missing field",
            ChatRequest {
                add_generation_prompt: false,
                continue_final_message: Some("nope".into()),
                ..ChatRequest::new(user())
            },
            "no \"nope\"",
        ),
    ];
    for (what, req, want) in cases {
        let e = t.render_request(&req, &special).expect_err(what).to_string();
        assert!(e.contains(want), "{what}: {e:?}");
    }
    let spin =
        ChatTemplate::new("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}".into())
            .expect("compiles");
    let e = spin.render_request(&ChatRequest::new(user()), &special).expect_err("out of fuel").to_string();
    assert!(e.to_lowercase().contains("fuel"), "{e}");
    // Templates that ask for more text than any prompt has: errors, not the memory or the time.
    for (what, source, want) in [
        ("a lazy list of 10^12 as JSON", "{{ ([0] * 1000000000000)|tojson }}", "bytes"),
        ("a lazy list of 10^12 printed", "{{ [0] * 1000000000000 }}", "bytes"),
        (
            "a list doubled 64 times",
            "{% set ns = namespace(v=[0]) %}{% for _ in range(64) %}{% set ns.v = [ns.v, ns.v] %}{% endfor %}{{ ns.v }}",
            "bytes",
        ),
        (
            "the same as JSON",
            "{% set ns = namespace(v=[0]) %}{% for _ in range(64) %}{% set ns.v = [ns.v, ns.v] %}{% endfor %}{{ ns.v|tojson }}",
            "bytes",
        ),
        ("a JSON indent of 10^8 spaces", "{{ [[1]]|tojson(indent=' ' * 100000000) }}", "bytes"),
        ("an indent of 10^13", "{{ 'a\nb'|indent(10000000000000) }}", "width"),
        // Each value within its bound, 10^11 bytes in all: the render's own bound.
        ("10^5 values of 1 MB", "{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}", "rendered prompt"),
        ("10^6 copies of a 1 kB literal", &format!("{{% for i in range(1000) %}}{{% for j in range(1000) %}}{}{{% endfor %}}{{% endfor %}}", "y".repeat(1000)), "rendered prompt"),
    ] {
        let t = ChatTemplate::new(source.into()).expect("compiles");
        let e = t.render_request(&ChatRequest::new(user()), &special).expect_err(what).to_string();
        assert!(e.contains(want), "{what}: {e}");
    }
    // Within its bounds the indent filter is Jinja2's: the text_filters case of chat.json.
}

fn parse(prompt: &str, text: &str, tools: Option<&[Value]>) -> ChatReply {
    let mut p = ReplyParser::new(prompt, tools);
    let mut streamed = Vec::new();
    for c in text.chars() {
        p.push(&c.to_string(), &mut |d| {
            streamed.push(match d {
                ChatDelta::Reasoning(r) => json!({"r": r}),
                ChatDelta::Content(c) => json!({"c": c}),
                ChatDelta::ToolCall(t) => json!({"t": t}),
            });
            true
        });
    }
    p.finish(&mut |_| true)
}

#[test]
fn the_parser_inverts_what_the_template_writes_for_an_assistant_turn() {
    let r = reference();
    let case = r["cases"].as_array().expect("cases").iter().find(|c| c["name"] == "tool_round_trip").expect("case");
    let prompt = case["prompt"].as_str().expect("prompt");
    let start = prompt.find("<|im_start|>user\nWeather").expect("user turn");
    let turn = &prompt[start..];
    let open = "<|im_start|>assistant\n";
    let body = &turn[turn.find(open).expect("assistant") + open.len()..];
    let body = &body[..body.find("<|im_end|>").expect("end")];
    let tools = case["tools"].as_array().expect("tools");
    let reply = parse(&prompt[..start], body, Some(tools));
    let msg = &case["messages"][1];
    assert_eq!(reply.reasoning_content.as_deref(), msg["reasoning_content"].as_str());
    assert_eq!(reply.content, msg["content"].as_str().expect("content"));
    let want: Vec<ToolCall> = msg["tool_calls"]
        .as_array()
        .expect("calls")
        .iter()
        .map(|c| ToolCall::new(c["function"]["name"].as_str().expect("name"), c["function"]["arguments"].clone()))
        .collect();
    assert_eq!(reply.tool_calls, want);
    // Thinking on: the prompt leaves <think> open, so the reply starts as reasoning.
    let reply = parse("<|im_start|>assistant\n<think>\n", "Hmm.\n</think>\n\nFour.", None);
    assert_eq!((reply.reasoning_content.as_deref(), reply.content.as_str()), (Some("Hmm."), "Four."));
    // And what the parser returns goes back into the conversation as the template expects.
    let back = ChatMessage::assistant(reply.reasoning_content.as_deref(), &reply.content, reply.tool_calls);
    let t = template("qwen35.jinja");
    let req =
        ChatRequest { add_generation_prompt: false, ..ChatRequest::new(vec![ChatMessage::new("user", "2+2?"), back]) };
    let text = t.render_request(&req, &Default::default()).expect("render");
    assert!(text.ends_with("<|im_start|>assistant\n<think>\nHmm.\n</think>\n\nFour.<|im_end|>\n"), "{text:?}");
}

/// The tokenizer of a `sanitize` case of chat.json, in a directory of its own: the fixture's
/// tokenizer with the case's extra added tokens, its config with the case's settings, and the
/// case's template.
fn sanitize_tokenizer(r: &Value, case: &Value, dir: &Path) -> TextTokenizer {
    let fixture = root().join(r["sanitize_tokenizer"].as_str().expect("dir"));
    let read = |name: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(fixture.join(name)).expect("fixture")).expect("json")
    };
    let mut tokenizer = read("tokenizer.json");
    let added = tokenizer["added_tokens"].as_array_mut().expect("added_tokens");
    for extra in case["extra_added"].as_array().expect("extra_added") {
        let mut t = json!({"single_word": false, "lstrip": false, "rstrip": false, "normalized": false});
        t.as_object_mut().expect("object").extend(extra.as_object().expect("token").clone());
        added.push(t);
    }
    let mut config = read("tokenizer_config.json");
    config.as_object_mut().expect("config").extend(case["config"].as_object().expect("config").clone());
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("dir");
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).expect("write");
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("write");
    let source = root().join("tests/fixtures/chat").join(case["template"].as_str().expect("template"));
    std::fs::copy(source, dir.join("chat_template.jinja")).expect("copy");
    TextTokenizer::from_dir(dir).expect("tokenizer")
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).expect("ids")
}

#[test]
fn prompts_encode_as_transformers_encodes_them_with_and_without_sanitized_control_tokens() {
    let r = reference();
    let dir = std::env::temp_dir().join(format!("qwen35-test-sanitize-{}", std::process::id()));
    for case in r["sanitize"].as_array().expect("sanitize cases") {
        let name = case["name"].as_str().expect("name");
        let tok = sanitize_tokenizer(&r, case, &dir);
        let plain = tok.encode_chat(&request(case)).expect(name);
        assert_eq!(plain.ids, ids(&case["ids"]), "{name}: ids without sanitize_control_tokens");
        let sanitized = tok.encode_chat(&request(case).sanitized(true));
        match (&case["sanitized_ids"], &case["sanitized_error"]) {
            (Value::Array(_), _) => {
                let sanitized = sanitized.expect(name);
                assert_eq!(sanitized.ids, ids(&case["sanitized_ids"]), "{name}: sanitized ids");
                let markers = ['\u{F0000}', '\u{F0001}'];
                assert!(!sanitized.text.contains(markers), "{name}: no marker is left in the prompt text");
            }
            (_, Value::String(error)) => {
                let e = sanitized.expect_err(name).to_string();
                let named = error.split_once("sanitize '").and_then(|(_, rest)| rest.split_once('\''));
                let token = named.expect("the token transformers names").0;
                assert!(e.contains(&format!("{token:?}")), "{name}: {e:?} should name {token:?} as {error:?} does");
            }
            _ => panic!("{name}: no reference"),
        }
    }
    // A continued message ending in a `<think>` the user wrote: the model read it as text when
    // sanitized, so the reply is content; unsanitized it is the token and the reply reasoning.
    let case = r["sanitize"].as_array().expect("cases").iter().find(|c| c["name"] == "continue_final_message");
    let case = case.expect("the continue_final_message case");
    let tok = sanitize_tokenizer(&r, case, &dir);
    let reply = |prompt: qwen35_wgpu::ChatPrompt| {
        let mut p = prompt.reply_parser(None);
        p.push(" more", &mut |_| true);
        let reply = p.finish(&mut |_| true);
        (reply.reasoning_content, reply.content)
    };
    let sanitized = tok.encode_chat(&request(case).sanitized(true)).expect("sanitized");
    assert!(sanitized.text.ends_with("<think>"), "{:?}", sanitized.text);
    assert_eq!(reply(sanitized), (None, " more".to_string()), "sanitized: content");
    assert_eq!(reply(tok.encode_chat(&request(case)).expect("plain")), (Some(" more".into()), String::new()));
    // A config's chat_control_tokens must be a list, as transformers requires.
    let mut bad = r["sanitize"].as_array().expect("cases")[0].clone();
    bad["config"] = json!({"chat_control_tokens": "<think>"});
    let tok = std::panic::catch_unwind(|| sanitize_tokenizer(&r, &bad, &dir));
    assert!(tok.is_err(), "a string for chat_control_tokens is refused");
    let e = TextTokenizer::from_dir(&dir).err().expect("refused").to_string();
    assert!(e.contains("chat_control_tokens") && e.contains("expected a list"), "{e}");
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

#[test]
fn tokenizer_directories_are_read_with_bounds() {
    let dir = std::env::temp_dir().join(format!("qwen35-test-tokenizer-bounds-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::copy(root().join("examples/assets/demo/tokenizer.json"), dir.join("tokenizer.json")).expect("copy");
    TextTokenizer::from_dir(&dir).expect("a tokenizer alone loads");
    // A FIFO must not block, an oversized (sparse) template must not be read.
    let fifo = dir.join("tokenizer_config.json");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success());
    let e = TextTokenizer::from_dir(&dir).err().expect("a FIFO is refused").to_string();
    assert!(e.contains("not a regular file"), "{e}");
    std::fs::remove_file(&fifo).expect("rm");
    let big = std::fs::File::create(dir.join("chat_template.jinja")).expect("create");
    big.set_len(qwen35_wgpu::text::MAX_TEMPLATE_BYTES as u64 + 1).expect("sparse");
    let e = TextTokenizer::from_dir(&dir).err().expect("an oversized template is refused").to_string();
    assert!(e.contains("bound"), "{e}");
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

#[test]
fn tokenizer_settings_that_would_panic_or_cut_prompts_are_refused_or_ignored() {
    let dir = std::env::temp_dir().join(format!("qwen35-test-tokenizer-settings-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let base: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("examples/assets/demo/tokenizer.json")).expect("tokenizer.json"),
    )
    .expect("json");
    let load = |edit: &dyn Fn(&mut Value)| {
        let mut t = base.clone();
        edit(&mut t);
        std::fs::write(dir.join("tokenizer.json"), t.to_string()).expect("write");
        TextTokenizer::from_dir(&dir)
    };
    let text = "What color is the sky? The sky is blue.";
    let want = load(&|_| {}).expect("the demo tokenizer").encode(text).expect("encode");
    assert!(want.len() > 2, "{want:?}");
    // Truncation (a stride tokenizers asserts against, a 1-token cut) and a huge fixed padding
    // are not applied: prompts are encoded whole.
    let truncating = load(&|t| {
        t["truncation"] = json!({"max_length": 1, "stride": 1, "strategy": "LongestFirst", "direction": "Right"})
    })
    .expect("loads");
    assert_eq!(truncating.encode(text).expect("no panic, no cut"), want);
    let padding = load(&|t| {
        t["padding"] = json!({"strategy": {"Fixed": 1_000_000_000_000u64}, "direction": "Right", "pad_to_multiple_of": null,
            "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"})
    })
    .expect("loads");
    assert_eq!(padding.encode(text).expect("no padding"), want);
    // A Strip decoder that strips at the end panics in tokenizers on some tokens: refused.
    let e = load(&|t| t["decoder"] = json!({"type": "Strip", "content": "a", "start": 1, "stop": 1}))
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("Strip") && e.contains("stop"), "{e}");
    let nested = json!({"type": "Sequence", "decoders": [{"type": "Strip", "content": " ", "start": 0, "stop": 2}]});
    assert!(load(&|t| t["decoder"] = nested.clone()).is_err(), "inside a sequence too");
    // A decoder field tokenizers' loader cannot parse (it `expect`s it to) is an error, not a
    // panic: a number out of f64's range, a lone surrogate, nesting past serde_json's limit.
    let mut marked = base.clone();
    marked["decoder"] = json!("@decoder@");
    let marked = marked.to_string();
    let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
    for raw in ["1e400", r#""\udc00""#, deep.as_str()] {
        std::fs::write(dir.join("tokenizer.json"), marked.replace(r#""@decoder@""#, raw)).expect("write");
        let e = TextTokenizer::from_dir(&dir).err().expect("refused").to_string();
        assert!(e.contains("tokenizer.json"), "{raw}: {e}");
    }
    // A Precompiled normalizer (tokenizers' loader expects a well-formed charsmap, an empty one
    // panics on the first encode) and a pre-tokenizer length of 0 (chunks(0)): refused before
    // tokenizers reads them, tagged, inside a sequence or untagged.
    let empty_charsmap = json!({"type": "Precompiled", "precompiled_charsmap": "AAAAAA=="});
    let bad_charsmap = json!({"type": "Precompiled", "precompiled_charsmap": "not base64"});
    let sequence = json!({"type": "Sequence", "normalizers": [{"type": "NFC"}, empty_charsmap.clone()]});
    let untagged = json!({"precompiled_charsmap": "AAAAAA=="});
    for normalizer in [empty_charsmap, bad_charsmap, sequence, untagged] {
        let e = load(&|t| t["normalizer"] = normalizer.clone()).err().expect("refused").to_string();
        assert!(e.contains("Precompiled"), "{normalizer}: {e}");
    }
    let fixed = json!({"type": "FixedLength", "length": 0});
    let nested = json!({"type": "Sequence", "pretokenizers": [{"type": "ByteLevel"}, fixed.clone()]});
    for pre in [fixed, nested] {
        let e = load(&|t| t["pre_tokenizer"] = pre.clone()).err().expect("refused").to_string();
        assert!(e.contains("length"), "{pre}: {e}");
    }
    let fixed_ok = load(&|t| t["pre_tokenizer"] = json!({"type": "FixedLength", "length": 4})).expect("length 4 loads");
    assert!(fixed_ok.encode(text).expect("encodes").len() > 2);
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

#[test]
fn named_templates_are_picked_as_transformers_picks_them_and_openai_arguments_parse() {
    let dir = std::env::temp_dir().join(format!("qwen35-test-named-templates-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::copy(root().join("examples/assets/demo/tokenizer.json"), dir.join("tokenizer.json")).expect("copy");
    let config = json!({"eos_token": "<|im_end|>", "chat_template": [
        {"name": "default", "template": "D{{ messages|length }}"},
        {"name": "tool_use", "template": "T{{ tools|length }}{{ messages[0].tool_calls[0].function.arguments.tz }}"}]});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("config");
    std::fs::write(
        dir.join("special_tokens_map.json"),
        json!({"bos_token": "<s>", "eos_token": "ignored"}).to_string(),
    )
    .expect("map");
    let tok = TextTokenizer::from_dir(&dir).expect("tokenizer");
    let special = &tok.special_tokens().0;
    assert!(special.contains(&("bos_token".into(), "<s>".into())), "{special:?}");
    assert!(special.contains(&("eos_token".into(), "<|im_end|>".into())), "tokenizer_config.json wins: {special:?}");
    let call: ChatMessage = serde_json::from_value(json!({"role": "assistant", "content": null,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "now", "arguments": "{\"tz\": \"UTC\"}"}}]}))
    .expect("OpenAI's shape, nulls included");
    assert_eq!(tok.render_chat(&ChatRequest::new(vec![call.clone()])).expect("default"), "D1");
    let tools = ChatRequest::new(vec![call]).with_tools(vec![json!({"type": "function"})]);
    assert_eq!(
        tok.render_chat(&tools).expect("tool_use"),
        "T1",
        "a string has no .tz: the template sees what was given"
    );
    assert_eq!(tok.render_chat(&tools.parse_tool_arguments()).expect("tool_use"), "T1UTC");
    // Each named template is compiled at load: a list longer than the cap is refused.
    let many: Vec<_> = (0..=qwen35_wgpu::text::MAX_NAMED_TEMPLATES)
        .map(|i| json!({"name": format!("t{i}"), "template": "x"}))
        .collect();
    std::fs::write(dir.join("tokenizer_config.json"), json!({"chat_template": many}).to_string()).expect("config");
    let e = TextTokenizer::from_dir(&dir).err().expect("too many templates").to_string();
    assert!(e.contains("at most 64 named templates, found 65"), "{e}");
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

//! The OpenAPI 3.1 document of the host's HTTP API (`docs/api.yaml`),
//! generated from the code: the paths from the host's route table
//! (`nl_vmm::api::http::ROUTES`), the `create` body from its Rust type
//! (schemars). `ninelives api --openapi` prints it; a test checks that the
//! committed `docs/api.yaml` is what the code generates (JSON is YAML).

use serde_json::{json, Map, Value};

use nl_launch::vm_spec::{ConfigFile, VmSpec};

fn error_response(what: &str) -> Value {
    json!({"description": what, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}})
}

fn json_body(schema: Value) -> Value {
    json!({"required": true, "content": {"application/json": {"schema": schema}}})
}

/// The operation object of one route.
fn operation(method: &str, path: &str, summary: &str) -> Value {
    let mut op = json!({
        "summary": summary,
        "operationId": format!("{}{}", method.to_lowercase(), path.replace(['/', '{', '}'], "_")),
    });
    let mut r = Map::new();
    r.insert("400".into(), error_response("Bad request"));
    r.insert("503".into(), error_response("Interrupted by a VMM recovery: retry"));
    let ok = |schema: Value| json!({"description": "OK", "content": {"application/json": {"schema": schema}}});
    let obj = json!({"type": "object"});
    if path.contains("{id}") {
        r.insert("404".into(), error_response("No such VM"));
    }
    if path.contains("{name}") {
        r.insert("404".into(), error_response("No such sandbox set"));
    }
    match (method, path) {
        ("POST", "/v1/vms") => {
            r.insert("201".into(), json!({"description": "Created", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Created"}}}}));
            r.insert(
                "409".into(),
                error_response(
                    "Refused by the host's memory or vCPU budget, or a rejuvenation in progress",
                ),
            );
            op["requestBody"] = json_body(json!({"$ref": "#/components/schemas/CreateVm"}));
        }
        ("POST", "/v1/sandboxes") => {
            r.insert("201".into(), json!({"description": "Created and started", "content": {"application/json": {"schema": {"type": "object", "properties": {"name": {"type": "string"}, "sandboxes": {"type": "array", "items": {"type": "string"}}}}}}}));
            r.insert(
                "409".into(),
                error_response(
                    "The name is taken, or the host's memory budget or a rejuvenation refuses it",
                ),
            );
            op["requestBody"] = json_body(
                json!({"type": "object", "required": ["name", "set"], "properties": {
                "name": {"type": "string", "description": "The set's name: 1 to 64 of [A-Za-z0-9_-]"},
                "set": {"type": "object", "description": "A sandbox configuration as `ninelives sandbox --config` reads it (docs/sandboxes.md)"},
                "timeout_secs": {"type": "number", "exclusiveMinimum": 0, "maximum": 604800, "description": "Sandboxes still running after this are stopped (default 3600)"}}}),
            );
        }
        ("POST", "/v1/sandboxes/{name}/inject") => {
            r.insert("200".into(), ok(json!({"type": "object", "properties": {"name": {"type": "string"}, "sandbox": {"type": "string"}, "fault": {"type": "object"}}})));
            r.insert(
                "409".into(),
                error_response("The set has ended, or a rejuvenation is in progress"),
            );
            op["requestBody"] = json_body(
                json!({"type": "object", "required": ["sandbox", "fault"], "properties": {
                "sandbox": {"type": "string", "description": "A sandbox of the set"},
                "fault": {"type": "object", "required": ["kind", "cpu"], "properties": {
                    "kind": {"enum": ["register", "spin"]},
                    "cpu": {"type": "integer", "minimum": 0},
                    "reg": {"type": "string", "description": "register: rax..r15, rip, rflags"},
                    "bit": {"type": "integer", "minimum": 0, "maximum": 63}}}}}),
            );
        }
        ("GET", "/v1/vms") => {
            r.insert("200".into(), ok(json!({"type": "object", "properties": {"vms": {"type": "array", "items": {"$ref": "#/components/schemas/VmSummary"}}}})));
        }
        ("PATCH", _) => {
            r.insert("200".into(), ok(obj));
            op["requestBody"] = json_body(json!({"$ref": "#/components/schemas/VmStateChange"}));
        }
        ("POST", "/v1/rejuvenate") => {
            r.insert("200".into(), ok(json!({"type": "object", "properties": {"report": {"type": "object"}, "handed_over": {"type": "boolean"}}})));
            r.insert("409".into(), error_response("A rejuvenation is in progress"));
            op["requestBody"] = json_body(json!({"$ref": "#/components/schemas/Rejuvenate"}));
        }
        ("GET", "/v1/events") => {
            op["parameters"] = json!([{"name": "after", "in": "query", "required": false, "schema": {"type": "integer", "minimum": 0}, "description": "Stream the events after this sequence number (default: only new ones); the Last-Event-ID header does the same."}]);
            r.insert("200".into(), json!({"description": "Server-sent events: `id: SEQ`, `event: KIND`, `data: {\"seq\",\"ts_ms\",\"kind\",\"data\"}`; kinds vm_created, vm_paused, vm_resumed, vm_destroyed, vm_ended, detection, recovery, rejuvenation, host_started, missed.", "content": {"text/event-stream": {"schema": {"type": "string"}}}}));
        }
        ("GET", "/metrics") => {
            r.insert("200".into(), json!({"description": "Prometheus text format 0.0.4", "content": {"text/plain": {"schema": {"type": "string"}}}}));
        }
        _ => {
            r.insert("200".into(), ok(obj));
        }
    }
    if path.contains("{id}") {
        op["parameters"] = json!([{"name": "id", "in": "path", "required": true, "schema": {"type": "integer", "minimum": 0}}]);
    }
    if path.contains("{name}") {
        op["parameters"] =
            json!([{"name": "name", "in": "path", "required": true, "schema": {"type": "string"}}]);
    }
    op["responses"] = Value::Object(r);
    op
}

/// The whole document.
pub fn document() -> Value {
    let mut paths = Map::new();
    for r in nl_vmm::api::http::ROUTES {
        let entry = paths.entry(r.path).or_insert_with(|| json!({}));
        entry[r.method.to_lowercase()] = operation(r.method, r.path, r.summary);
    }
    let mut create = serde_json::to_value(schemars::schema_for!(VmSpec)).expect("a schema");
    let defs = create.as_object_mut().and_then(|o| o.remove("$defs")).unwrap_or(json!({}));
    if let Some(o) = create.as_object_mut() {
        o.remove("$schema");
    }
    let mut schemas = Map::new();
    schemas.insert("CreateVm".into(), create);
    // Not an API body: the configuration file of `run --config` and
    // `host --config`, published with the API's schemas.
    let mut config = serde_json::to_value(schemars::schema_for!(ConfigFile)).expect("a schema");
    if let Some(o) = config.as_object_mut() {
        o.remove("$schema");
        o.remove("$defs");
        o.insert("description".into(), json!("The configuration file of `ninelives run --config` and `ninelives host --config` (docs/config.md)."));
    }
    schemas.insert("ConfigFile".into(), config);
    if let Value::Object(d) = defs {
        schemas.extend(d);
    }
    schemas.insert("Created".into(), json!({"type": "object", "required": ["id"], "properties": {"id": {"type": "integer", "minimum": 0}}}));
    schemas.insert("Error".into(), json!({"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}, "interrupted": {"type": "boolean"}}}));
    schemas.insert("VmStateChange".into(), json!({"type": "object", "required": ["state"], "properties": {"state": {"enum": ["paused", "running"]}}}));
    schemas.insert("VmSummary".into(), json!({"type": "object", "properties": {"id": {"type": "integer"}, "state": {"type": "string"}, "workload": {"type": "string"}, "vcpus": {"type": "integer"}, "mem_bytes": {"type": "integer"}}}));
    schemas.insert("Rejuvenate".into(), json!({"type": "object", "required": ["mode"], "properties": {
        "mode": {"enum": ["warm", "cold", "save-restore"]},
        "binary": {"type": "string", "description": "The new VMM binary (default: this one)"},
        "image_dir": {"type": "string", "description": "save-restore: where memory images go"},
        "timeout_secs": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600},
        "prespawn": {"type": "boolean", "description": "warm: start the successor before pausing (default true)"}}}));
    // Schemas refer to each other under components, not $defs.
    let text = Value::Object(schemas).to_string().replace("#/$defs/", "#/components/schemas/");
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "ninelives host API",
            "version": format!("{}", nl_vmm::api::http::VERSION),
            "description": "HTTP/1.1 over the host's Unix socket (ninelives host --api SOCKET), e.g. `curl --unix-socket SOCKET http://localhost/v1/vms`. Generated by `ninelives api --openapi`; see docs/api.md.",
        },
        "servers": [{"url": "http://localhost"}],
        "paths": paths,
        "components": {"schemas": serde_json::from_str::<Value>(&text).expect("valid JSON")},
    })
}

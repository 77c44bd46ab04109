// Reading a tool's JSON Schema for the form: $ref resolved, Optional[X] seen as X, and the
// kind of editor a schema gets.

export function resolve(schema, root) {
  let current = schema || {};
  for (let depth = 0; depth < 20 && current.$ref; depth += 1) {
    const name = current.$ref.replace(/^#\/(\$defs|definitions)\//, "");
    current = { ...((root.$defs || root.definitions || {})[name] || {}),
                ...Object.fromEntries(Object.entries(current).filter(([k]) => k !== "$ref")) };
  }
  const options = current.anyOf || current.oneOf;
  if (options) {  // Optional[X] is anyOf [X, null]: edit X
    const real = options.filter((option) => option.type !== "null");
    if (real.length === 1) {
      return { ...resolve(real[0], root), description: current.description,
               default: current.default, title: current.title };
    }
  }
  return current;
}

// "object", "array", "boolean", "enum", "integer", "number", "string" or "json" (anything
// else, edited as JSON text).
export function typeOf(schema) {
  if (Array.isArray(schema.enum)) return "enum";
  if (Array.isArray(schema.type)) return schema.type.find((t) => t !== "null") || "json";
  if (schema.type) return schema.type;
  if (schema.properties) return "object";
  return "json";
}

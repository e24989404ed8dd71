-- ember.nvim: Neovim client for the ember LSP code-completion server.
--
-- Put editors/nvim on the runtimepath (e.g. `vim.opt.rtp:append('/path/to/ember/editors/nvim')`
-- or with a plugin manager) and call:
--
--   require('ember').setup({
--     cmd = { 'ember', '--stdio' },          -- how to start the server (default)
--     cmd_env = { EMBER_API_KEY = '...' },    -- extra environment for the server (optional)
--     -- tcp = { host = '127.0.0.1', port = 7777 }, -- or connect to `ember --tcp` (Neovim >= 0.8)
--     filetypes = { 'python', 'lua' },        -- default: a list of common languages
--     settings = { maxTokens = 64, debounceMs = 50 },  -- sent as initializationOptions and as
--                                                      -- workspace/didChangeConfiguration {ember=...}
--   })
--
-- Keys of `settings` (camelCase, all optional): model, engine, engineUrl (string or list), maxTokens,
-- debounceMs, contextTokens, temperature, earlyAnswerMs, maxRequestsPerSecond, token (for TCP
-- servers that require one).
--
-- What you get:
-- * Neovim >= 0.12: native inline completion (ghost text, `vim.lsp.inline_completion`).
--   Set `accept_key = '<Tab>'` to accept a suggestion with that key in insert mode.
-- * Older versions (0.7 - 0.11): `omnifunc` is set to `v:lua.vim.lsp.omnifunc`, so <C-x><C-o>
--   shows ember's completion. On >= 0.11, `autotrigger = true` also enables
--   `vim.lsp.completion` with autotrigger.
-- * `require('ember').status()` returns a short text for a statusline ("ember: Loading model 40%").
--
-- Neovim 0.7 lacks `vim.lsp.start`; there the plugin uses `vim.lsp.start_client` and
-- `vim.lsp.buf_attach_client` on FileType, reusing one client per root directory.
local M = {}

M.defaults = {
  name = 'ember',
  cmd = { 'ember', '--stdio' },
  cmd_env = nil, -- extra environment for the server process, e.g. { EMBER_API_KEY = '...' }
  tcp = nil, -- { host = '127.0.0.1', port = 7777 } or 'host:port'
  filetypes = {
    'python', 'javascript', 'javascriptreact', 'typescript', 'typescriptreact',
    'rust', 'go', 'java', 'c', 'cpp', 'lua', 'sh',
  },
  settings = {},
  root_markers = { '.git', 'pyproject.toml', 'package.json', 'Cargo.toml', 'go.mod' },
  inline = nil, -- nil: use inline completion when the Neovim version has it
  omnifunc = true, -- set omnifunc when inline completion is not used
  autotrigger = false, -- Neovim >= 0.11: vim.lsp.completion.enable with autotrigger
  accept_key = nil, -- Neovim >= 0.12 inline completion: insert-mode key that accepts
  debounce_text_changes = 50,
  on_attach = nil, -- function(client, bufnr) called after ember's own setup
}

M.config = nil
local clients_by_root = {} -- Neovim 0.7: root_dir -> client id
local progress = {} -- token -> { title, message, percentage }
M.progress_log = {} -- every $/progress value seen (kind/title/message), for tests and debugging
local last_error = nil

local function notify(msg, level)
  vim.schedule(function()
    vim.notify('ember: ' .. msg, level or vim.log.levels.INFO)
  end)
end

--- Parses 'host:port', '[::1]:port', 'port' or { host=, port= } into host, port.
function M.parse_tcp(tcp)
  if type(tcp) == 'table' then
    return tcp.host or '127.0.0.1', tonumber(tcp.port)
  end
  if type(tcp) == 'number' then
    return '127.0.0.1', tcp
  end
  local s = tostring(tcp)
  local host, port = s:match('^%[(.+)%]:(%d+)$')
  if not host then
    host, port = s:match('^(.*):(%d+)$')
  end
  if not port then
    port = s:match('^(%d+)$')
  end
  if host == nil or host == '' then
    host = '127.0.0.1'
  end
  return host, tonumber(port)
end

local function find_root(bufnr, markers)
  local fname = vim.api.nvim_buf_get_name(bufnr)
  local start = fname ~= '' and vim.fn.fnamemodify(fname, ':p:h') or vim.fn.getcwd()
  if vim.fs and vim.fs.find then
    local found = vim.fs.find(markers, { path = start, upward = true })[1]
    if found then
      return vim.fn.fnamemodify(found, ':h')
    end
    return start
  end
  -- Neovim 0.7: no vim.fs
  for _, marker in ipairs(markers) do
    local dir = vim.fn.finddir(marker, start .. ';')
    if dir ~= '' then
      return vim.fn.fnamemodify(dir, ':p:h:h')
    end
    local file = vim.fn.findfile(marker, start .. ';')
    if file ~= '' then
      return vim.fn.fnamemodify(file, ':p:h')
    end
  end
  return start
end

local function progress_handler(err, result, ctx, config)
  if result and result.value and type(result.value) == 'table' and result.value.kind then
    local v = result.value
    local key = tostring(result.token)
    table.insert(M.progress_log, { kind = v.kind, title = v.title, message = v.message, percentage = v.percentage })
    if v.kind == 'begin' then
      progress[key] = { title = v.title, message = v.message, percentage = v.percentage }
    elseif v.kind == 'report' and progress[key] then
      progress[key].message = v.message or progress[key].message
      progress[key].percentage = v.percentage or progress[key].percentage
    elseif v.kind == 'end' then
      progress[key] = nil
    end
    pcall(vim.cmd, 'redrawstatus')
  end
  local default = vim.lsp.handlers['$/progress']
  if default then
    return default(err, result, ctx, config)
  end
end

local function show_message_handler(err, result, ctx, config)
  if result and result.type == 1 then -- MessageType.Error
    last_error = result.message
  end
  return vim.lsp.handlers['window/showMessage'](err, result, ctx, config)
end

--- Short status for a statusline: load progress, last error, or "ember".
function M.status()
  for _, p in pairs(progress) do
    local parts = {}
    if p.title and p.title ~= '' and p.title:lower() ~= 'ember' then
      table.insert(parts, p.title)
    end
    if p.message and p.message ~= '' then
      table.insert(parts, p.message)
    end
    local s = 'ember: ' .. table.concat(parts, ': ')
    if p.percentage then
      s = s .. ' ' .. p.percentage .. '%'
    end
    return s
  end
  if last_error then
    return 'ember: error: ' .. last_error
  end
  return 'ember'
end

local function has_inline()
  return vim.lsp.inline_completion ~= nil and vim.lsp.inline_completion.enable ~= nil
end

--- True for completion items that came from an ember client.
local function is_ember_item(item, lsp_data, bufnr)
  if item.insertTextFormat == 2 then
    return false -- snippets are Neovim's business
  end
  if lsp_data.client_id then -- Neovim >= 0.10 records the client
    local client = vim.lsp.get_client_by_id(lsp_data.client_id)
    return client ~= nil and client.name == M.config.name
  end
  -- Neovim 0.7: ember's items insert at the cursor (empty textEdit range).
  local te = item.textEdit
  if type(te) ~= 'table' or type(te.range) ~= 'table' then
    return false
  end
  local s, e = te.range.start, te.range['end']
  if s.line ~= e.line or s.character ~= e.character then
    return false
  end
  local clients = vim.lsp.get_clients and vim.lsp.get_clients({ bufnr = bufnr }) or vim.lsp.buf_get_clients(bufnr)
  for _, c in pairs(clients) do
    if c.name == M.config.name then
      return true
    end
  end
  return false
end

--- The omnifunc menu can insert only `word`: Neovim 0.11 cuts a plain-text item at its first
--- whitespace ("factorial(n - 1)" -> "factorial(n"), 0.7 puts NULs where newlines were.
--- After an ember item is accepted, replace what the menu inserted by the item's whole text.
local function complete_done(bufnr)
  local ci = vim.v.completed_item
  if type(ci) ~= 'table' or type(ci.user_data) ~= 'table' or type(ci.user_data.nvim) ~= 'table' then
    return
  end
  local lsp_data = ci.user_data.nvim.lsp
  local item = type(lsp_data) == 'table' and lsp_data.completion_item
  if type(item) ~= 'table' or not is_ember_item(item, lsp_data, bufnr) then
    return
  end
  local full = (type(item.textEdit) == 'table' and item.textEdit.newText) or item.insertText
  if type(full) ~= 'string' or full == '' then
    return
  end
  local inserted = (ci.word or ''):gsub('\n', '\0')
  local row, col = unpack(vim.api.nvim_win_get_cursor(0))
  local line = vim.api.nvim_buf_get_lines(bufnr, row - 1, row, false)[1] or ''
  local start = col - #inserted
  if inserted == full or start < 0 or line:sub(start + 1, col) ~= inserted then
    return
  end
  local lines = vim.split(full, '\n', { plain = true })
  vim.api.nvim_buf_set_text(bufnr, row - 1, start, row - 1, col, lines)
  local end_col = (#lines == 1 and start or 0) + #lines[#lines]
  vim.api.nvim_win_set_cursor(0, { row + #lines - 1, end_col })
end

local function on_attach(client, bufnr)
  local cfg = M.config
  local use_inline = cfg.inline
  if use_inline == nil then
    use_inline = has_inline()
  end
  if use_inline and has_inline() then
    vim.lsp.inline_completion.enable(true, { bufnr = bufnr })
    if cfg.accept_key then
      -- Not an <expr> mapping: accepting edits the buffer, which <expr> mappings may not do.
      local key = vim.api.nvim_replace_termcodes(cfg.accept_key, true, false, true)
      vim.keymap.set('i', cfg.accept_key, function()
        if not vim.lsp.inline_completion.get({ bufnr = bufnr }) then
          vim.api.nvim_feedkeys(key, 'n', false) -- nothing to accept: the key's usual meaning
        end
      end, { buffer = bufnr, desc = 'ember: accept inline completion' })
    end
  elseif cfg.omnifunc then
    vim.bo[bufnr].omnifunc = 'v:lua.vim.lsp.omnifunc'
    vim.api.nvim_create_autocmd('CompleteDone', {
      group = vim.api.nvim_create_augroup('ember_complete_' .. bufnr, { clear = true }),
      buffer = bufnr,
      callback = function()
        complete_done(bufnr)
      end,
    })
    if cfg.autotrigger and vim.lsp.completion and vim.lsp.completion.enable then
      vim.lsp.completion.enable(true, client.id, bufnr, { autotrigger = true })
    end
  end
  if cfg.on_attach then
    cfg.on_attach(client, bufnr)
  end
end

--- The client config passed to vim.lsp.start / vim.lsp.start_client.
function M.client_config(bufnr)
  local cfg = M.config
  local cmd = cfg.cmd
  if cfg.tcp then
    local host, port = M.parse_tcp(cfg.tcp)
    if not (vim.lsp.rpc and vim.lsp.rpc.connect) then
      error('ember: connecting over TCP needs Neovim >= 0.8 (vim.lsp.rpc.connect)')
    end
    if not port then
      error('ember: tcp must be "host:port", got ' .. vim.inspect(cfg.tcp))
    end
    cmd = vim.lsp.rpc.connect(host, port)
  end
  local settings = vim.deepcopy(cfg.settings or {})
  if next(settings) == nil then
    settings = vim.empty_dict() -- JSON {} (an empty Lua table would be sent as [])
  end
  return {
    name = cfg.name,
    cmd = cmd,
    cmd_env = cfg.cmd_env,
    root_dir = find_root(bufnr, cfg.root_markers),
    init_options = settings,
    -- Neovim sends workspace/didChangeConfiguration with these after initialize and answers
    -- workspace/configuration from them.
    settings = { ember = settings },
    handlers = {
      ['$/progress'] = progress_handler,
      ['window/showMessage'] = show_message_handler,
    },
    flags = { debounce_text_changes = cfg.debounce_text_changes },
    on_attach = on_attach,
    on_exit = function(code, signal)
      if code ~= 0 and code ~= nil then
        last_error = 'server exited with code ' .. tostring(code)
        notify(last_error, vim.log.levels.ERROR)
      end
    end,
  }
end

--- Starts (or reuses) the ember client for a buffer and attaches it. Returns the client id.
function M.attach(bufnr)
  bufnr = (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
  local ok, config = pcall(M.client_config, bufnr)
  if not ok then
    last_error = tostring(config)
    notify(last_error, vim.log.levels.ERROR)
    return nil
  end
  if vim.lsp.start then
    return vim.lsp.start(config, { bufnr = bufnr })
  end
  -- Neovim 0.7
  local id = clients_by_root[config.root_dir]
  local client = id and vim.lsp.get_client_by_id(id)
  if not client or client.is_stopped() then
    id = vim.lsp.start_client(config)
    if not id then
      last_error = 'could not start ' .. vim.inspect(config.cmd)
      notify(last_error, vim.log.levels.ERROR)
      return nil
    end
    clients_by_root[config.root_dir] = id
  end
  vim.lsp.buf_attach_client(bufnr, id)
  return id
end

--- Sends new settings to running ember clients (workspace/didChangeConfiguration).
function M.update_settings(settings)
  M.config.settings = vim.tbl_deep_extend('force', M.config.settings or {}, settings or {})
  local get = vim.lsp.get_clients or vim.lsp.get_active_clients
  for _, client in ipairs(get()) do
    if client.name == M.config.name then
      local settings = vim.deepcopy(M.config.settings)
      if next(settings) == nil then
        settings = vim.empty_dict()
      end
      client.config.settings = { ember = settings }
      client.notify('workspace/didChangeConfiguration', { settings = client.config.settings })
    end
  end
end

function M.setup(opts)
  M.config = vim.tbl_deep_extend('force', vim.deepcopy(M.defaults), opts or {})
  if opts and opts.filetypes then
    M.config.filetypes = opts.filetypes -- replace, not merge, the list
  end
  if opts and opts.cmd then
    M.config.cmd = opts.cmd
  end
  local group = vim.api.nvim_create_augroup('ember', { clear = true })
  vim.api.nvim_create_autocmd('FileType', {
    group = group,
    pattern = M.config.filetypes,
    callback = function(args)
      M.attach(args.buf)
    end,
  })
  -- Buffers already open when setup() runs.
  for _, buf in ipairs(vim.api.nvim_list_bufs()) do
    if vim.api.nvim_buf_is_loaded(buf) and vim.tbl_contains(M.config.filetypes, vim.bo[buf].filetype) then
      M.attach(buf)
    end
  end
  return M
end

return M
